"""Supervised fine-tuning data (`data=sft`): conversations from `composerun-tokenize --chat`.

Each chat shard `tokens_NNNNN.bin` has beside it a loss mask (`.loss_mask`: one byte a
token, 1 where the token is trained on as a target) and its documents' first offsets
(`.doc_starts`: int64, ascending, the first 0), both named by its sidecar.  A document (one
conversation) never spans two shards.

A row holds seq_len+1 tokens; its inputs are the first seq_len, its targets the same shifted
by one, and a target counts (is not IGNORE_INDEX) only where the mask trains that token, the
token is not padding, and it is not a document's first token (which no earlier token of its
own document predicts).  Two layouts (`data.packing`):

- packed (true): documents in a seeded per-epoch order are packed greedily into rows (a
  row closes before a document that does not fit; a document longer than a row is cut to
  one row), the rest of a row padded.  The inputs are `Packed`: the tokens and each one's
  position in its own document, so the model attends within documents only
  (models/llama.py) and every document's rotary positions start at 0.
- padded (false): one document a row, cut to seq_len+1 tokens and right-padded; the inputs
  are the token ids (padding only follows the document, so causal attention suffices).

Sample i is a pure function of (seed, i): epoch e's document order is a permutation drawn
by numpy's Generator seeded with (seed, e), as data=tokens draws its windows'; packed, its
rows are that order's greedy packing, and sample i is row i - (the rows of epochs before e).
The packing of an epoch (a pass over its documents' lengths) is made when first needed and
kept with its row count, so a resume far into the run packs each earlier epoch once.

The held-out split is the last `data.val_fraction` of each shard's documents (at least one),
or the shards of `data.val_path`; `.val` gives its rows in document order, the same at every
evaluation.
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
from composerun.config.schema import ModelConfig, Task
from composerun.data.sources import IGNORE_INDEX, Packed, resolve_seq_len, token_loss_sum
from composerun.errors import ConfigError

PAD_ID = 0  # the token id of padding (its targets never count, and no document attends to it)


class Documents:
    """Some documents of chat shards, numbered in order: each its shard and token range.
    The shards are memory-mapped lazily, in the process that reads them (a pickled copy for a
    DataLoader worker carries only the paths)."""

    def __init__(self, shards: list[tuple[Path, np.dtype, Path]], spans: np.ndarray) -> None:
        self.shards, self.spans = shards, spans  # spans: [shard index, start, end] a document
        self.lengths = spans[:, 2] - spans[:, 1] if len(spans) else np.zeros(0, np.int64)
        self.count = len(spans)
        self._maps: list[tuple[np.ndarray, np.ndarray]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def read(self, d: int, most: int) -> tuple[np.ndarray, np.ndarray]:
        """Document d's first `most` tokens (int64) and their mask (bool)."""
        if self._maps is None:
            self._maps = [
                (tf.open_shard(p, dtype), np.memmap(m, dtype=np.uint8, mode="r")) for p, dtype, m in self.shards
            ]
        k, lo, hi = (int(v) for v in self.spans[d])
        hi = min(hi, lo + most)
        tokens, mask = self._maps[k]
        return tokens[lo:hi].astype(np.int64), mask[lo:hi].astype(bool)


def pack(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The first document of each row when documents of these lengths (each at most
    `capacity`) are packed greedily in order: a row closes before a document that does not fit."""
    firsts, fill = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if fill + n > capacity:
            firsts.append(k)
            fill = 0
        fill += n
    return np.asarray(firsts if len(lengths) else [], dtype=np.int64)


def make_rows(docs: Documents, rows: list[list[int]], seq_len: int, packed: bool) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) of rows of the given documents (the module's docstring)."""
    cap = seq_len + 1
    tok = np.full((len(rows), cap), PAD_ID, dtype=np.int64)
    counts = np.zeros((len(rows), cap), dtype=bool)
    pos = np.zeros((len(rows), cap), dtype=np.int64)
    for r, members in enumerate(rows):
        at = 0
        for d in members:
            t, m = docs.read(d, cap - at)
            n = len(t)
            tok[r, at : at + n], counts[r, at : at + n], pos[r, at : at + n] = t, m, np.arange(n)
            counts[r, at] = False  # a document's first token: no earlier token of its own predicts it
            at += n
        pos[r, at:] = np.arange(cap - at)  # padding: a segment of its own, after every document
    targets = torch.from_numpy(np.where(counts[:, 1:], tok[:, 1:], IGNORE_INDEX))
    tokens = torch.from_numpy(tok[:, :-1])
    return (Packed(tokens, torch.from_numpy(pos[:, :-1])) if packed else tokens), targets


class Rows:
    """Documents in a fixed order as rows: packed greedily, or one a row."""

    def __init__(self, docs: Documents, order: np.ndarray, seq_len: int, packed: bool) -> None:
        self.docs, self.order, self.seq_len, self.packed = docs, order, seq_len, packed
        self.firsts = pack(np.minimum(docs.lengths[order], seq_len + 1), seq_len + 1) if packed else None
        self.size = len(self.firsts) if packed else len(order)

    def members(self, r: int) -> list[int]:
        """The documents of row r."""
        if not self.packed:
            return [int(self.order[r])]
        end = self.firsts[r + 1] if r + 1 < self.size else len(self.order)
        return [int(d) for d in self.order[self.firsts[r] : end]]

    def batch(self, rows: Sequence[int]) -> tuple[Any, torch.Tensor]:
        return make_rows(self.docs, [self.members(r) for r in rows], self.seq_len, self.packed)


class HeldOutRows(Rows):
    """The held-out documents' rows, in order; sample i is row i (modulo their number)."""

    def batch(self, indices: Sequence[int]) -> tuple[Any, torch.Tensor]:
        return super().batch([i % self.size for i in indices])

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return masked_loss(out, target)


def masked_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the targets that count."""
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX)


class SFTData:
    """Chat conversations, packed or padded, the loss on their trained tokens (the module's docstring)."""

    task = "tokens"
    every_target_counts = False  # (masked targets: the trainer all-reduces their count)

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
        packing: bool = True,
    ) -> None:
        if Task(model.task) is not Task.tokens:
            raise ConfigError(
                f"data=sft feeds token ids; model {model.name or model._target_} has model.task={Task(model.task).value}"
            )
        if path is None:
            raise ConfigError("data=sft needs data.path: the folder of shards composerun-tokenize --chat wrote")
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be at least 0 and below 1")
        self.seed, self.seq_len, self.packing, self.tokenizer = (
            seed,
            resolve_seq_len(model, seq_len),
            packing,
            tokenizer,
        )
        if self.seq_len < 2:
            raise ConfigError(
                f"data.seq_len={self.seq_len} is too small for data=sft: a row needs a prompt token and an answer"
            )
        train = read_chat_shards(path, "data.path", token_dtype, model.vocab_size)
        held = read_chat_shards(val_path, "data.val_path", token_dtype, model.vocab_size) if val_path else []
        self.key_of = {s[0]: "data.path" for s, _ in train} | {s[0]: "data.val_path" for s, _ in held}
        if val_path or val_fraction == 0:
            train_docs, held_docs = _documents(train), _documents(held) if held else None
        else:
            train_docs, held_docs = _split(train, val_fraction)
        if val_path and held_docs.count == 0:
            raise ConfigError(f"data.val_path={val_path}: the held-out split has no document")
        if train_docs.count == 0:
            raise ConfigError(f"data.path={path}: the shards hold no document to train on")
        self.train = train_docs
        self._check_trains(train_docs)
        self.val = HeldOutRows(held_docs, np.arange(held_docs.count), self.seq_len, packing) if held_docs else None
        self._epochs: dict[int, Rows] = {}
        self._rows_before: list[int] = [0]  # rows of epochs 0..e-1, for e = 0, 1, ... as far as packed

    def _check_trains(self, docs: Documents) -> None:
        """At least one training document has a trained target within a row's seq_len+1 tokens."""
        cap = self.seq_len + 1
        for d in range(docs.count):
            _, m = docs.read(d, cap)
            if m[1:].any():
                return
        raise ConfigError(
            f"data.seq_len={self.seq_len} is too small: no training document has a trained token within its first "
            f"{cap} tokens (the prompt before the first answer is longer); raise data.seq_len"
        )

    def files(self) -> list[tuple[Path, np.dtype, str]]:
        """Every shard read (training and held-out), its dtype, and the key that named it."""
        shards = self.train.shards + (self.val.docs.shards if self.val else [])
        return list({p: (p, d, self.key_of[p]) for p, d, _ in shards}.values())

    def epoch(self, e: int) -> Rows:
        """Epoch e's rows: its seeded order of the training documents, packed or one a row."""
        rows = self._epochs.get(e)
        if rows is None:
            order = np.random.default_rng([self.seed, e]).permutation(self.train.count)
            rows = Rows(self.train, order, self.seq_len, self.packing)
            # a batch spans at most two epochs; replaced whole, so a reading thread sees either dict
            self._epochs = {k: v for k, v in self._epochs.items() if k == e - 1} | {e: rows}
        return rows

    def row_of(self, i: int) -> tuple[int, int]:
        """(epoch, row) of sample i."""
        while self._rows_before[-1] <= i:  # (each epoch's row count, once, as far as i)
            e = len(self._rows_before) - 1
            self._rows_before.append(self._rows_before[-1] + self.epoch(e).size)
        e = int(np.searchsorted(self._rows_before, i, side="right")) - 1
        return e, i - self._rows_before[e]

    def batch(self, indices: Sequence[int]) -> tuple[Any, torch.Tensor]:
        places = [self.row_of(int(i)) for i in indices]
        members = [self.epoch(e).members(r) for e, r in places]
        return make_rows(self.train, members, self.seq_len, self.packing)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_epochs": {}, "_rows_before": [0]}  # (caches, made again where needed)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return masked_loss(out, target)

    def loss_sum(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(out, target)

    def counted(self, target: torch.Tensor) -> torch.Tensor:
        return (target != IGNORE_INDEX).sum()


Shard = tuple[Path, np.dtype, Path]  # tokens, their dtype, the loss mask


def read_chat_shards(path: str, key: str, token_dtype: str | None, vocab: int | None) -> list[tuple[Shard, np.ndarray]]:
    """Each chat shard `key` names, with its documents' starts; a shard without a loss mask
    (composerun-tokenize without --chat) is refused."""
    out = []
    for f in tf.find_shards(path, key):
        meta = tf.read_sidecar(f) or {}
        if not (
            meta.get("chat") and isinstance(meta.get("loss_mask"), str) and isinstance(meta.get("doc_starts"), str)
        ):
            raise ConfigError(
                f"{key}: {f} has no loss mask (its sidecar {tf.sidecar_of(f).name} names none): "
                "data=sft needs shards from composerun-tokenize --chat"
            )
        dtype = tf.bin_dtype(f, token_dtype, vocab) if f.suffix == ".bin" else None
        n = tf.shard_length(f, dtype, key)
        mask, starts = f.parent / meta["loss_mask"], f.parent / meta["doc_starts"]
        if not mask.is_file() or mask.stat().st_size != n:
            raise ConfigError(
                f"{key}: {f}'s loss mask {mask.name} is missing or not one byte for each of its {n} tokens"
            )
        doc_starts = np.fromfile(starts, dtype=np.int64) if starts.is_file() else np.zeros(0, np.int64)
        if n and (not len(doc_starts) or doc_starts[0] != 0 or (np.diff(doc_starts) <= 0).any() or doc_starts[-1] >= n):
            raise ConfigError(f"{key}: {f}'s document starts {starts.name} are missing or not ascending offsets from 0")
        out.append(((f, dtype, mask), doc_starts if n else np.zeros(0, np.int64)))
    return out


def _spans(k: int, starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """[shard k, start, end] of each document of a shard."""
    if not len(starts):
        return np.zeros((0, 3), np.int64)
    ends = np.append(starts[1:], n_tokens)
    return np.stack([np.full(len(starts), k), starts, ends], axis=1).astype(np.int64)


def _documents(shards: list[tuple[Shard, np.ndarray]]) -> Documents:
    spans = []
    for k, (s, starts) in enumerate(shards):
        n = tf.shard_length(s[0], s[1], "data.path")
        spans.append(_spans(k, starts, n))
    table = np.concatenate(spans) if spans else np.zeros((0, 3), np.int64)
    return Documents([s for s, _ in shards], table)


def _split(shards: list[tuple[Shard, np.ndarray]], fraction: float) -> tuple[Documents, Documents]:
    """The first documents of each shard train, its last `fraction` (at least one) are held out."""
    train, held = [], []
    for k, (s, starts) in enumerate(shards):
        spans = _spans(k, starts, tf.shard_length(s[0], s[1], "data.path"))
        n_held = max(math.ceil(len(spans) * fraction), 1)
        if len(spans) - n_held < 1:
            raise ConfigError(
                f"data.val_fraction={fraction}: {s[0]} holds {len(spans)} document(s), too few to hold out one and "
                "train on the rest; give data.val_path, or data.val_fraction=0"
            )
        train.append(spans[:-n_held])
        held.append(spans[-n_held:])
    shard_list = [s for s, _ in shards]
    return Documents(shard_list, np.concatenate(train)), Documents(shard_list, np.concatenate(held))
