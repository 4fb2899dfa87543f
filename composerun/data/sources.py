"""Deterministic data, indexed by global sample index.

Sample i is a pure function of (data.seed, i), so step s of any mesh sees the same global
batch — samples [s*B, (s+1)*B) — and each data-parallel rank takes its contiguous slice.
That makes runs on different meshes comparable and resume mesh-portable: the only data
state is the number of samples consumed.

The loss is a mean over the targets that count, weighted by them across the whole global
batch (train/trainer.py divides each micro-batch's sum by the global count).  A source says
what counts and what the sum is through `counted(target)` and `loss_sum(out, target)`; a
token target of IGNORE_INDEX never counts.  A source without them (a user's, with only
`.loss`, a mean) counts its samples, each weighing the same: `counted` and `summed_loss`.
`every_target_counts` (a class attribute) says no target of the source is ever ignored, so
the global count follows from the batch's shape, without communication.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from composerun.config.schema import Config, ModelConfig, Task, target_class
from composerun.errors import ConfigError

IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index)


def token_loss_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the targets that are not IGNORE_INDEX."""
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def counted(data: Any, target: torch.Tensor) -> torch.Tensor:
    """How many of `target`'s elements count in data's loss (an int64 tensor on target's
    device): the source's `counted`, else one per sample."""
    own = getattr(data, "counted", None)
    if own is not None:
        return own(target)
    return torch.full((), target.shape[0], dtype=torch.int64, device=target.device)


def summed_loss(data: Any, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """data's loss summed over what `counted` counts: the source's `loss_sum`, else its mean
    loss times the samples."""
    own = getattr(data, "loss_sum", None)
    if own is not None:
        return own(out, target)
    return data.loss(out, target) * target.shape[0]


class Packed(NamedTuple):
    """A batch's inputs when its rows hold several documents (data=sft's packing): the token
    ids and each token's position in its own document, which restarts at 0 at each document's
    first token (so the model attends within documents only: models/llama.py).  Sources whose
    rows are one sequence each give a plain tensor of token ids instead.  It moves, pins and
    lives like the tensors it holds, so the loader treats it as one."""

    tokens: torch.Tensor
    position_ids: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, *args: Any, **kwargs: Any) -> Packed:
        return Packed(self.tokens.to(*args, **kwargs), self.position_ids.to(*args, **kwargs))

    def pin_memory(self) -> Packed:
        return Packed(self.tokens.pin_memory(), self.position_ids.pin_memory())


def forward(model: Any, x: Any) -> torch.Tensor:
    """The model's output for a batch's inputs: `model(x)`, or for Packed inputs
    `model(tokens, position_ids=...)` (transformers' name, which composerun's Llama shares)."""
    if isinstance(x, Packed):
        return model(x.tokens, position_ids=x.position_ids)
    return model(x)


def token_ids(x: Any) -> torch.Tensor:
    """The token ids (or features) of a batch's inputs."""
    return x.tokens if isinstance(x, Packed) else x


def _gen(seed: int, i: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + i)


def resolve_seq_len(model: ModelConfig, seq_len: int | None) -> int:
    """Tokens per training sequence: data.seq_len, else model.seq_len.  (Against the model's
    max_seq_len: `check_seq_len`, for a run that trains.)"""
    n, key = (model.seq_len, "model.seq_len") if seq_len is None else (seq_len, "data.seq_len")
    if n < 1:
        raise ConfigError(f"{key}={n}: must be at least 1")
    return n


def check_seq_len(cfg: Config) -> None:
    """The training sequence at most the model's max_seq_len (model.kwargs.max_seq_len, where
    the model has one), before any rank starts.  A run with train.steps=0 (load, then export or
    verify) forwards no sequence: a pretrained model is exported whatever the length asked."""
    if cfg.train.steps == 0:
        return
    n, key = (cfg.model.seq_len, "model.seq_len") if cfg.data.seq_len is None else (cfg.data.seq_len, "data.seq_len")
    cap = (cfg.model.kwargs or {}).get("max_seq_len")
    if isinstance(cap, int) and n > cap:
        if cfg.model.pretrained:  # its config.json fixes the cap: raising it would be refused
            fix = f"shorten {key} (max_position_embeddings in {cfg.model.pretrained}/config.json)"
        else:
            fix = f"shorten {key}, or raise model.kwargs.max_seq_len"
        raise ConfigError(f"{key}={n} is larger than the model's max_seq_len={cap} (model.kwargs.max_seq_len): {fix}")


class HeldOutSequence:
    """A held-out token sequence cut into consecutive windows of seq_len+1 tokens, seq_len
    apart; sample i is window i (modulo their number), the same every evaluation."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, loss: Any) -> None:
        self.tokens, self.seq_len, self.loss = tokens, seq_len, loss
        self.size = (len(tokens) - 1) // seq_len

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.seq_len
        t = torch.stack([self.tokens[(i % self.size) * n : (i % self.size) * n + n + 1] for i in indices])
        return t[:, :-1], t[:, 1:]


class HeldOutDraws:
    """Held-out samples of a data source that makes its own: sample i is the source's draw
    for index -2 - i, a seed stream no training sample uses (those are 0, 1, ...; -1 made the
    source's fixed map).  Fresh draws of the same rule, so the validation loss measures how
    well the rule was learnt, not memorised samples."""

    SIZE = 1 << 16

    def __init__(self, source: Any) -> None:
        self.source, self.size, self.loss = source, self.SIZE, source.loss

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.batch([-2 - (i % self.size) for i in indices])


class SyntheticData:
    """Regression: x ~ N(0, I), y = (c + tanh(x A)) / 2 for a fixed offset c and map A:
    the offset is learnt in a few steps (a short run shows the loss falling), the map
    takes longer.  Tokens: sequences that follow a fixed random successor map from a
    random start, so the loss can fall to ~0."""

    def __init__(self, model: ModelConfig, seed: int = 1234, seq_len: int | None = None) -> None:
        self.task = Task(model.task).value
        self.seed = seed
        if self.task == "regression":
            self.in_dim = model.in_dim or model.dim
            self.out_dim = model.out_dim or model.dim
            if not self.in_dim or not self.out_dim:
                raise ConfigError("model.in_dim/out_dim (or model.dim) must be set for regression data")
        else:
            self.vocab = (model.vocab_size or 0) + (model.fusion_vocab_size or 0)
            if self.vocab < 2:
                raise ConfigError("model.vocab_size must be at least 2 for token data")
            self.seq_len = resolve_seq_len(model, seq_len)
        self._rules: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _rule(self) -> tuple[torch.Tensor, ...]:
        """The fixed rule (regression: the map A and the offset c; tokens: the successor map),
        made at the first batch on the default device, not when the source is built: the
        launcher's checks build the source and read a batch on the meta device, and an
        in_dim x out_dim map of a large model.dim would cost gigabytes there."""
        device = torch.empty(0).device  # (the meta device inside the checks' `with torch.device("meta")`)
        if device not in self._rules:
            g = _gen(self.seed, -1)
            if self.task == "regression":
                teacher = torch.randn(self.in_dim, self.out_dim, generator=g) / self.in_dim**0.5
                self._rules[device] = (teacher, torch.randn(self.out_dim, generator=g))
            else:
                self._rules[device] = (torch.randperm(self.vocab, generator=g),)
        return self._rules[device]

    @property
    def val(self) -> Any:
        """The held-out source evaluation reads (HeldOutDraws, unless set; a subclass may say
        None with a class attribute)."""
        return self.__dict__.setdefault("_val", HeldOutDraws(self))

    @val.setter
    def val(self, value: Any) -> None:
        self.__dict__["_val"] = value

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.task == "regression":
            teacher, offset = self._rule()
            x = torch.stack([torch.randn(self.in_dim, generator=_gen(self.seed, i)) for i in indices])
            return x, 0.5 * (offset + torch.tanh(x @ teacher))
        (successor,) = self._rule()
        tok = torch.cat([torch.randint(self.vocab, (1,), generator=_gen(self.seed, i)) for i in indices])
        cols = [tok]
        for _ in range(self.seq_len):  # the whole batch walks the successor map together
            tok = successor[tok]
            cols.append(tok)
        t = torch.stack(cols, dim=1)
        return t[:, :-1], t[:, 1:]

    every_target_counts = True  # (the module's docstring)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            return F.mse_loss(out, target)
        return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())

    def loss_sum(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss summed over every element (regression) or target token."""
        if self.task == "regression":
            return F.mse_loss(out, target, reduction="sum")
        return token_loss_sum(out, target)

    def counted(self, target: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            return torch.full((), target.numel(), dtype=torch.int64, device=target.device)
        return (target != IGNORE_INDEX).sum()


def meta_batch(data: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of n samples as meta tensors, for the launcher's checks: its shapes and dtypes,
    no memory (a synthetic source's batch, and the map that makes it, would be real tensors of
    model.dim's size).  A source whose batch needs real values (a text's random offsets read
    to the host) makes a real one: its size is the data's, which its files bound."""
    try:
        with torch.device("meta"):
            x, y = data.batch(range(n))
        if x.device.type == "meta" and y.device.type == "meta":
            return x, y
    except Exception:  # noqa: BLE001 - a source that cannot run on meta tensors: the real batch below
        pass
    return data.batch(range(n))


class TextData(SyntheticData):
    """Byte-level next-token prediction over a local text file (default: nine of
    Shakespeare's sonnets, shipped with composerun): sample i is the window starting at a
    pseudo-random offset drawn from (seed, i) in the text's first part; the last
    `val_fraction` (at least one window) is held out, its windows in order (`.val`)."""

    def __init__(
        self,
        model: ModelConfig,
        seed: int = 1234,
        path: str | None = None,
        seq_len: int | None = None,
        val_fraction: float = 0.01,
    ) -> None:
        p = Path(path) if path else Path(str(files("composerun") / "assets" / "sonnets.txt"))
        if not p.is_file():
            raise ConfigError(f"data.path={path}: no such file")
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be at least 0 and below 1")
        self.task = "tokens"
        self.seed = seed
        self.seq_len = n = resolve_seq_len(model, seq_len)
        text = p.read_bytes()
        held = max(math.ceil(len(text) * val_fraction), n + 1) if val_fraction else 0
        if len(text) - held <= n + 1:  # an empty file too, which torch.frombuffer refuses
            also = (
                f" for training after holding out data.val_fraction={val_fraction} (at least a window)" if held else ""
            )
            raise ConfigError(f"data.path={path or p}: too short: fewer than seq_len+1={n + 1} bytes{also}")
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.tokens = tokens[: len(text) - held]
        self.val = HeldOutSequence(tokens[len(text) - held :], n, self.loss) if held else None
        if (model.vocab_size or 0) < 256:
            raise ConfigError(f"model.vocab_size={model.vocab_size}: byte-level text needs at least 256")

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        span = len(self.tokens) - self.seq_len - 1
        starts = [int(torch.randint(span, (1,), generator=_gen(self.seed, i))) for i in indices]
        t = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        return t[:, :-1], t[:, 1:]


# DataConfig fields a data source receives when its constructor names them (besides seed).
DATA_OPTIONS = ("path", "seq_len", "val_fraction", "val_path", "token_dtype", "tokenizer", "packing")
_READS_FILES = ("path", "val_path")


def build_data(cfg: Config) -> Any:
    """The data source as the ranks build it: `cls(model_config, seed=data.seed, ...)` with every
    other DataConfig field of DATA_OPTIONS that its signature names (all of them for a class
    taking **kwargs).  A file to read given to a class that reads none is refused: it would
    silently train on its own data."""
    dcfg = cfg.data
    cls = target_class("data._target_", dcfg._target_)
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {"seed": dcfg.seed}
    for name in DATA_OPTIONS:
        value = getattr(dcfg, name)
        value = value.value if hasattr(value, "value") else value  # an enum's value (token_dtype)
        if name in params or takes_any:
            kwargs[name] = value
        elif name == "packing" and not value:
            raise ConfigError(f"data.packing=false: data._target_={dcfg._target_} packs no documents; leave it out")
        elif name in _READS_FILES and value is not None:
            raise ConfigError(
                f"data.{name}={value}: data._target_={dcfg._target_} reads no file (it would train on "
                "its own data); choose a data source that does, such as data=text or data=tokens, or leave "
                f"data.{name} out"
            )
    return cls(cfg.model, **kwargs)
