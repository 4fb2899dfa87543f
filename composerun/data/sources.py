"""Deterministic data, indexed by global sample index.

Sample i is a pure function of (data.seed, i), so step s of any mesh sees the same global
batch — samples [s*B, (s+1)*B) — and each data-parallel rank takes its contiguous slice.
That makes runs on different meshes comparable and resume mesh-portable: the only data
state is the number of samples consumed.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from composerun.config.schema import Config, ModelConfig, Task, target_class
from composerun.errors import ConfigError


def _gen(seed: int, i: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + i)


class SyntheticData:
    """Regression: x ~ N(0, I), y = (c + tanh(x A)) / 2 for a fixed offset c and map A:
    the offset is learnt in a few steps (a short run shows the loss falling), the map
    takes longer.  Tokens: sequences that follow a fixed random successor map from a
    random start, so the loss can fall to ~0."""

    def __init__(self, model: ModelConfig, seed: int = 1234) -> None:
        self.task = Task(model.task).value
        self.seed = seed
        g = _gen(seed, -1)
        if self.task == "regression":
            self.in_dim = model.in_dim or model.dim
            self.out_dim = model.out_dim or model.dim
            if not self.in_dim or not self.out_dim:
                raise ConfigError("model.in_dim/out_dim (or model.dim) must be set for regression data")
            self.teacher = torch.randn(self.in_dim, self.out_dim, generator=g) / self.in_dim**0.5
            self.offset = torch.randn(self.out_dim, generator=g)
        else:
            self.vocab = (model.vocab_size or 0) + (model.fusion_vocab_size or 0)
            if self.vocab < 2:
                raise ConfigError("model.vocab_size must be at least 2 for token data")
            self.seq_len = model.seq_len
            self.successor = torch.randperm(self.vocab, generator=g)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.task == "regression":
            x = torch.stack([torch.randn(self.in_dim, generator=_gen(self.seed, i)) for i in indices])
            return x, 0.5 * (self.offset + torch.tanh(x @ self.teacher))
        tok = torch.cat([torch.randint(self.vocab, (1,), generator=_gen(self.seed, i)) for i in indices])
        cols = [tok]
        for _ in range(self.seq_len):  # the whole batch walks the successor map together
            tok = self.successor[tok]
            cols.append(tok)
        t = torch.stack(cols, dim=1)
        return t[:, :-1], t[:, 1:]

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            return F.mse_loss(out, target)
        return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


class TextData(SyntheticData):
    """Byte-level next-token prediction over a local text file (default: nine of
    Shakespeare's sonnets, shipped with composerun): sample i is the window starting at a
    pseudo-random offset drawn from (seed, i)."""

    def __init__(self, model: ModelConfig, seed: int = 1234, path: str | None = None) -> None:
        p = Path(path) if path else Path(str(files("composerun") / "assets" / "sonnets.txt"))
        if not p.is_file():
            raise ConfigError(f"data.path={path}: no such file")
        self.task = "tokens"
        self.seed = seed
        self.seq_len = model.seq_len
        text = p.read_bytes()
        if len(text) <= self.seq_len + 1:  # an empty file too, which torch.frombuffer refuses
            raise ConfigError(f"data.path={path}: shorter than model.seq_len+1={self.seq_len + 1} bytes")
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        if (model.vocab_size or 0) < 256:
            raise ConfigError(f"model.vocab_size={model.vocab_size}: byte-level text needs at least 256")

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        span = len(self.tokens) - self.seq_len - 1
        starts = [int(torch.randint(span, (1,), generator=_gen(self.seed, i))) for i in indices]
        t = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        return t[:, :-1], t[:, 1:]


def build_data(cfg: Config) -> Any:
    """The data source as the ranks build it, `cls(model_config, seed=data.seed[, path=data.path])`;
    `data.path` only for one that reads a file."""
    dcfg = cfg.data
    cls = target_class("data._target_", dcfg._target_)
    params = inspect.signature(cls).parameters
    takes_path = "path" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if dcfg.path is not None and not takes_path:
        raise ConfigError(
            f"data.path={dcfg.path}: data._target_={dcfg._target_} reads no file (it would train on "
            "its own data); choose a data source that does, such as data=text, or leave data.path out"
        )
    kwargs: dict[str, Any] = {"seed": dcfg.seed}
    if takes_path:
        kwargs["path"] = dcfg.path
    return cls(cfg.model, **kwargs)
