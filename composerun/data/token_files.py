"""Token shards on disk: finding them, opening them memory-mapped, and their sidecars.

A shard is a flat array of token ids: a raw `.bin` file of uint16 or uint32 (what
`composerun-tokenize` writes, nanoGPT's format) or a `.npy` file (its own dtype).  Shards are
only ever memory-mapped: a training run reads the few pages its windows touch, so a
corpus larger than memory trains as well as a small one.

Beside each shard `composerun-tokenize` writes a sidecar, `<shard stem>.json`: how many
tokens, the largest id, the dtype, and the tokenizer (path relative to the sidecar, and its
vocabulary size).  The launcher's checks read it instead of scanning the shard; a shard with
no sidecar (or one that no longer matches its shard) is scanned in chunks, and so is a signed
`.npy` shard always (a sidecar records no smallest id, and a negative one must be refused).
"""

from __future__ import annotations

import glob
import json
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from composerun.errors import ConfigError

TOKEN_SUFFIXES = (".bin", ".npy")
SCAN_CHUNK = 1 << 24  # tokens read at a time when a shard's largest id is not recorded


def shipped_shards() -> Path:
    """The shards composerun ships: the shipped corpus tokenized with the shipped tokenizer."""
    return Path(str(files("composerun") / "assets" / "tokens"))


def shipped_tokenizer() -> Path:
    return Path(str(files("composerun") / "assets" / "tokenizer"))


def find_shards(path: str | None, key: str) -> list[Path]:
    """The token files that `key`=path names: one file, every `.bin`/`.npy` file of a directory,
    or a glob's matches, in sorted order (the order fixes the global window numbering)."""
    if path is None:
        path = str(shipped_shards())
    p = Path(path)
    if p.is_file():
        if p.suffix not in TOKEN_SUFFIXES:
            raise ConfigError(
                f"{key}={path}: not a token file; name a .bin or .npy file, a directory or a glob of them"
            )
        return [p]
    found = sorted(p.glob("*")) if p.is_dir() else sorted(Path(m) for m in glob.glob(path, recursive=True))
    shards = [f for f in found if f.suffix in TOKEN_SUFFIXES and f.is_file()]
    if not shards:
        where = "directory holds" if p.is_dir() else "matches"
        raise ConfigError(
            f"{key}={path}: {where} no .bin or .npy token file; tokenize text with composerun-tokenize, "
            "or name a file, a directory or a glob of shards"
        )
    return shards


def sidecar_of(shard: Path) -> Path:
    return shard.with_suffix(".json")


def write_shard(shard: Path, tokens: np.ndarray, meta: dict[str, Any]) -> None:
    """A raw shard and its sidecar (its size, largest id and dtype, then `meta`)."""
    tokens.tofile(shard)
    side = {"tokens": len(tokens), "max_id": int(tokens.max()), "dtype": tokens.dtype.name, **meta}
    sidecar_of(shard).write_text(json.dumps(side, indent=1) + "\n")


def read_sidecar(shard: Path) -> dict[str, Any] | None:
    """The shard's sidecar, or None where there is none or it cannot be read."""
    try:
        meta = json.loads(sidecar_of(shard).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def default_dtype(vocab_size: int | None) -> np.dtype:
    """uint16 holds every id of a vocabulary of at most 65536 tokens; larger ones need uint32."""
    return np.dtype(np.uint16 if (vocab_size or 0) <= 1 << 16 else np.uint32)


def bin_dtype(shard: Path, token_dtype: str | None, vocab_size: int | None) -> np.dtype:
    """A raw shard's element type: data.token_dtype, else its sidecar's, else by the vocabulary."""
    recorded = (read_sidecar(shard) or {}).get("dtype")
    if token_dtype is not None:
        if recorded is not None and recorded != token_dtype:
            raise ConfigError(
                f"data.token_dtype={token_dtype}: {shard} was written as {recorded} ({sidecar_of(shard).name}); "
                f"set data.token_dtype={recorded} or leave it out"
            )
        return np.dtype(token_dtype)
    return np.dtype(recorded) if recorded in ("uint16", "uint32") else default_dtype(vocab_size)


def open_shard(shard: Path, dtype: np.dtype) -> np.ndarray:
    """The shard memory-mapped read-only (no page is read until used)."""
    if shard.suffix == ".npy":
        return np.load(shard, mmap_mode="r")
    return np.memmap(shard, dtype=dtype, mode="r")


def shard_length(shard: Path, dtype: np.dtype, key: str) -> int:
    """How many tokens the shard holds, from its size (a `.bin`) or its header (a `.npy`); a
    file that is not a flat array of integer ids is refused."""
    if shard.suffix == ".npy":
        try:
            arr = np.load(shard, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {shard} is not a readable .npy array ({str(e).splitlines()[0]})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"{key}: {shard} holds a {arr.dtype} array of shape {arr.shape}; token files are 1-D integer arrays"
            )
        return int(arr.shape[0])
    size = shard.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"{key}: {shard} has {size} bytes, not a whole number of {dtype.name} tokens; "
            "check data.token_dtype (or the file is truncated)"
        )
    return size // dtype.itemsize


def id_range(shard: Path, dtype: np.dtype) -> tuple[int, int]:
    """The smallest and largest ids in the shard.  An unsigned shard's smallest is taken as 0
    and its largest is its sidecar's record where the sidecar still describes the shard (same
    count and dtype); otherwise (no such sidecar, or a signed `.npy` that may hold a negative
    id) the memory map is scanned, SCAN_CHUNK tokens at a time."""
    arr = open_shard(shard, dtype)
    signed = arr.dtype.kind == "i"
    meta = read_sidecar(shard) or {}
    if (
        not signed
        and meta.get("tokens") == len(arr)
        and meta.get("dtype") == arr.dtype.name
        and isinstance(meta.get("max_id"), int)
    ):
        return 0, meta["max_id"]
    lo, hi = 0, -1
    for i in range(0, len(arr), SCAN_CHUNK):
        chunk = arr[i : i + SCAN_CHUNK]
        hi = max(hi, int(chunk.max()))
        if signed:
            lo = min(lo, int(chunk.min()))
    return lo, hi


@cache
def tokenizer_vocab_size(path: Path, key: str) -> int:
    """The vocabulary size of the Hugging Face tokenizer.json that `key` names, its added tokens
    included; a file the tokenizers library cannot read is the user's mistake, said in one line."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{key}: {path} is not a Hugging Face tokenizer.json ({reason}); "
            "name a tokenizer.json (or a directory with one) that the tokenizers library reads"
        ) from None
    return tok.get_vocab_size(with_added_tokens=True)


def tokenizer_file(path: str | Path, key: str) -> Path:
    """The tokenizer.json that `key`=path names (the file, or a directory holding one)."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(
            f"{key}={path}: no tokenizer.json there; name a Hugging Face tokenizer.json or a directory with one"
        )
    return f


def recorded_tokenizer(shard: Path) -> tuple[Path | None, int | None]:
    """The tokenizer a shard's sidecar records (its path, resolved from the sidecar's folder)
    and that tokenizer's vocabulary size."""
    meta = read_sidecar(shard) or {}
    tok, vocab = meta.get("tokenizer"), meta.get("vocab_size")
    path = (shard.parent / tok).resolve() if isinstance(tok, str) else None
    return path, vocab if isinstance(vocab, int) else None
