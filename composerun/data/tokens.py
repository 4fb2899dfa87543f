"""Pre-tokenized data (`data=tokens`): sequences read from memory-mapped token shards.

`data.path` names the shards (one file, a directory, or a glob; null: the shipped corpus,
tokenized with the shipped tokenizer).  Each shard is cut into windows of seq_len+1 tokens,
seq_len apart (a window's last token is the next one's first, so every token but a shard's
first is a target exactly once); inputs are a window's first seq_len tokens, targets the
same shifted by one.  Windows never cross a shard's end, so shards are independent documents'
streams and can be added or removed one by one.

Sample i is a pure function of (seed, i), as every composerun data source's is: the training
windows are numbered across the shards in sorted order, and epoch e = i // windows visits
them in the order of a permutation drawn by numpy's Generator seeded with (seed, e).  A
permutation rather than sampling with replacement: each window is seen exactly once per
epoch, as a pass over the data should, and a resume, another mesh or another batch split
still meets the same window at the same sample index.  The permutation (8 bytes a window)
is made once per epoch and kept: a 10 B-token corpus at seq_len 2048 needs 40 MB for it.

The held-out split is the last `data.val_fraction` of each shard's tokens (at least one
window, so the default works for a single file), or the shards of `data.val_path` (then
every token of data.path trains).  `.val` gives its windows in order: evaluation sees the
same samples every time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import composerun.data.token_files as tf
from composerun.config.schema import Config, ModelConfig, Task
from composerun.data.sources import IGNORE_INDEX, resolve_seq_len, token_loss_sum
from composerun.errors import ConfigError

Region = tuple[Path, np.dtype, int, int]  # a shard, its dtype, and the token range [lo, hi) used


class Windows:
    """The windows of seq_len+1 tokens, seq_len apart, of some shard regions, numbered in order.

    The shards are memory-mapped lazily, in the process that reads them: pickled (a
    DataLoader worker started by spawn) it carries only the paths, never the mapped data."""

    def __init__(self, regions: list[Region], seq_len: int) -> None:
        self.regions, self.seq_len = regions, seq_len
        counts = [(hi - lo - 1) // seq_len for _, _, lo, hi in regions]
        self.ends = np.cumsum(counts, dtype=np.int64)
        self.count = int(self.ends[-1]) if counts else 0
        self._maps: list[np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def window(self, w: int) -> np.ndarray:
        """Window w's seq_len+1 tokens, as int64 (copied out of the map)."""
        if self._maps is None:
            self._maps = [tf.open_shard(path, dtype) for path, dtype, _, _ in self.regions]
        k = int(np.searchsorted(self.ends, w, side="right"))
        first = w - (int(self.ends[k - 1]) if k else 0)
        start = self.regions[k][2] + first * self.seq_len
        return self._maps[k][start : start + self.seq_len + 1].astype(np.int64)

    def tokens(self, windows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(np.stack([self.window(w) for w in windows]))
        return t[:, :-1], t[:, 1:]


def token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as SyntheticData's token task has it."""
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


class HeldOut:
    """The held-out windows, in order; sample i is window i (modulo their number)."""

    def __init__(self, windows: Windows) -> None:
        self.windows, self.size = windows, windows.count

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows.tokens([i % self.size for i in indices])

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss(out, target)


class TokenData:
    """Windows of pre-tokenized shards in a per-epoch shuffled order (the module's docstring)."""

    task = "tokens"
    every_target_counts = True  # (data/sources.py)

    def __init__(
        self,
        model: ModelConfig,
        seed: int = 1234,
        path: str | None = None,
        seq_len: int | None = None,
        val_fraction: float = 0.01,
        val_path: str | None = None,
        token_dtype: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        if Task(model.task) is not Task.tokens:
            raise ConfigError(
                f"data=tokens feeds token ids; model {model.name or model._target_} has model.task={Task(model.task).value}: "
                "choose a token model (+model=llama3_debug, +model=transformer)"
            )
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be at least 0 and below 1")
        self.seed, self.seq_len = seed, resolve_seq_len(model, seq_len)
        self.tokenizer = tokenizer
        vocab = model.vocab_size
        train = _shards(path, "data.path", token_dtype, vocab, self.seq_len)
        held = _shards(val_path, "data.val_path", token_dtype, vocab, self.seq_len) if val_path else []
        if val_path or val_fraction == 0:
            train_regions = [(p, d, 0, n) for p, d, n in train]
            held_regions = [(p, d, 0, n) for p, d, n in held]
        else:
            train_regions, held_regions = _split(train, val_fraction, self.seq_len)
        self.key_of = {p: "data.path" for p, _, _ in train} | {p: "data.val_path" for p, _, _ in held}
        self.train = Windows(train_regions, self.seq_len)
        self.val = HeldOut(Windows(held_regions, self.seq_len)) if held_regions else None
        self._orders: dict[int, np.ndarray] = {}

    def files(self) -> list[tuple[Path, np.dtype, str]]:
        """Every shard read (training and held-out), its dtype, and the key that named it."""
        regions = self.train.regions + (self.val.windows.regions if self.val else [])
        return list({p: (p, d, self.key_of[p]) for p, d, _, _ in regions}.values())

    def window_of(self, i: int) -> int:
        """The training window sample i reads: place i % W of epoch i // W's permutation."""
        epoch, place = divmod(int(i), self.train.count)
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.train.count)
            # a batch spans at most two epochs; replaced whole, so a reading thread sees either dict
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
        return int(order[place])

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train.tokens([self.window_of(i) for i in indices])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_orders": {}}  # (a cache, made again where it is needed)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss(out, target)

    def loss_sum(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(out, target)

    def counted(self, target: torch.Tensor) -> torch.Tensor:
        return (target != IGNORE_INDEX).sum()


def _shards(path: str | None, key: str, token_dtype: str | None, vocab: int | None, seq_len: int) -> list:
    """(file, dtype, tokens) of every shard `key` names, each long enough for one window."""
    out = []
    for f in tf.find_shards(path, key):
        dtype = tf.bin_dtype(f, token_dtype, vocab) if f.suffix == ".bin" else None
        n = tf.shard_length(f, dtype, key)
        if n < seq_len + 1:
            what = "holds no tokens" if n == 0 else f"holds {n} tokens, fewer than data.seq_len+1={seq_len + 1}"
            raise ConfigError(f"{key}: {f} {what}; remove it from the shards, or shorten data.seq_len")
        out.append((f, dtype, n))
    return out


def _split(shards: list, fraction: float, seq_len: int) -> tuple[list[Region], list[Region]]:
    """The first part of each shard trains, its last `fraction` (at least one window) is held out."""
    train, held = [], []
    for f, dtype, n in shards:
        n_held = max(math.ceil(n * fraction), seq_len + 1)
        if n - n_held < seq_len + 1:
            raise ConfigError(
                f"data.val_fraction={fraction}: {f} holds {n} tokens, too few to hold out one window of "
                f"data.seq_len+1={seq_len + 1} and train on the rest; give data.val_path, or data.val_fraction=0"
            )
        train.append((f, dtype, 0, n - n_held))
        held.append((f, dtype, n - n_held, n))
    return train, held


# --- the launcher's checks ------------------------------------------------------------------


def run_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer.json of the run's tokens: data.tokenizer, else model.pretrained's, else the
    one the first token shard's sidecar records (where it still exists)."""
    if cfg.data.tokenizer:
        return tf.tokenizer_file(cfg.data.tokenizer, "data.tokenizer")
    if cfg.model.pretrained and (Path(cfg.model.pretrained) / "tokenizer.json").is_file():
        return Path(cfg.model.pretrained) / "tokenizer.json"
    if str(cfg.data._target_).endswith(("TokenData", "SFTData")):
        recorded, _ = tf.recorded_tokenizer(tf.find_shards(cfg.data.path, "data.path")[0])
        if recorded is not None and recorded.is_file():
            return recorded
    return None


def check_tokens(cfg: Config, data: Any) -> None:
    """Before any rank starts: the run's tokenizer is readable and fits model.vocab_size, and
    every token id of every shard is at least 0 and below it (read from the sidecars, or scanned)."""
    vocab = cfg.model.vocab_size
    if vocab is None:
        return
    tok = run_tokenizer(cfg) if cfg.data.tokenizer or cfg.model.pretrained else None  # (else: each shard's)
    key = "data.tokenizer" if cfg.data.tokenizer else "model.pretrained"
    if tok is not None and (size := tf.tokenizer_vocab_size(tok, key)) > vocab:
        raise ConfigError(
            f"{key}: the tokenizer {tok} has {size} tokens, more than model.vocab_size={vocab}: "
            "use the model's own tokenizer, or a model whose vocabulary holds it"
        )
    if not callable(getattr(data, "files", None)):  # (TokenData and SFTData list their shards)
        return
    for shard, dtype, key in data.files():
        recorded, size = tf.recorded_tokenizer(shard)
        if tok is None and size is not None and size > vocab:
            raise ConfigError(
                f"{key}: {shard} was tokenized with {recorded} ({size} tokens), more than model.vocab_size={vocab}: "
                "tokenize with the model's tokenizer, or choose a model whose vocabulary holds it"
            )
        low, top = tf.id_range(shard, dtype)
        if low < 0:
            raise ConfigError(
                f"{key}: {shard} holds token id {low}, below 0: token ids run from 0 to model.vocab_size-1; "
                "tokenize with the model's tokenizer (or check the array's values)"
            )
        if top >= vocab:
            raise ConfigError(
                f"{key}: {shard} holds token id {top}, not below model.vocab_size={vocab}: tokenize with the "
                "model's tokenizer (or check data.token_dtype)"
            )
