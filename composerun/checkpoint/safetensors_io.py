"""Safetensors files written and read in pieces, so that no process needs a whole model.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape and
byte range) and the tensors' bytes, row-major.  The header follows from the keys, dtypes and
shapes alone, so it can be written first; then each rank writes the rows it holds straight
into their byte range (`pwrite`), and reads only the rows it needs (safetensors' `get_slice`).
The file is the one `safetensors.torch.save_file` writes for the same tensors (the same
order of the data, a header padded to 8 bytes), and `load_file` opens it.

A model in several files (Hugging Face's sharded layout) has an index,
`model.safetensors.index.json`, whose `weight_map` names each key's file; `Source` reads a
single file, such an index, or a torch file of tensors (memory-mapped) alike.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

from composerun.errors import CheckpointError

INDEX_SUFFIX = ".safetensors.index.json"

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def layout(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, dict[str, int], int]:
    """(the file's first bytes: length and header; each key's byte offset in the file; the
    file's size).  The data in safetensors' own order: widest dtype first, then by key."""
    order = sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})} if metadata else {}
    at, starts = 0, {}
    for key in order:
        dtype, shape = specs[key]
        if dtype not in DTYPES:
            raise CheckpointError(f"{key}: safetensors has no dtype {dtype}")
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        starts[key] = at
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors pads it
    head = struct.pack("<Q", len(text)) + text
    return head, {k: len(head) + s for k, s in starts.items()}, len(head) + at


def create(path: Path, head: bytes, size: int) -> None:
    """A file of `size` bytes that starts with `head`; the rest is written in place later."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # the mode any new file gets (umask)
        f.write(head)
        f.truncate(size)


def write_at(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Write a tensor's bytes (row-major) at `offset`; the bytes written."""
    data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return done


def read_index(path: Path) -> dict[str, Path]:
    """Each key's file, from a `model.safetensors.index.json`."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        return {str(k): path.parent / str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors index ({e!r})") from None


class Source:
    """Tensors by key from a safetensors file, an index of several, or a torch file of
    tensors; whole, or only some rows of dim 0, reading no more than those."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self._files: dict[Path, Any] = {}
        self._torch: dict[str, torch.Tensor] | None = None
        if path.name.endswith(INDEX_SUFFIX):
            self.where = read_index(path)
        elif path.suffix == ".safetensors":
            self.where = dict.fromkeys(self._open(path).keys(), path)
        else:
            self._torch = _load_torch(path, what)
            self.where = dict.fromkeys(self._torch, path)

    def _open(self, path: Path) -> Any:
        from safetensors import SafetensorError, safe_open

        if path not in self._files:
            try:
                self._files[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                where = "" if path == self.path else f" {path}"
                raise CheckpointError(f"{self.what}:{where} not a readable safetensors file ({e})") from None
        return self._files[path]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._torch is not None:
            return {k: tuple(v.shape) for k, v in self._torch.items()}
        out = {}
        for key, path in self.where.items():
            f = self._open(path)
            if key not in f.keys():
                raise CheckpointError(f"{self.what}: the index names {path.name} for {key}, which does not hold it")
            out[key] = tuple(f.get_slice(key).get_shape())
        return out

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor under `key`, or only its rows [start, stop) of dim 0."""
        if self._torch is not None:
            t = self._torch[key]
            return (t if rows is None else t[rows[0] : rows[1]]).clone()
        from safetensors import SafetensorError

        try:
            f = self._open(self.where[key])
            return f.get_tensor(key) if rows is None else f.get_slice(key)[rows[0] : rows[1]]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.what}: reading {key} from {self.where[key]}: {e}") from None


def _load_torch(path: Path, what: str) -> dict[str, torch.Tensor]:
    """A torch file of tensors, memory-mapped (only what is sliced is read); never unpickles objects."""
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)  # torch's legacy format has no mmap
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__  # one line, not torch's essay
        raise CheckpointError(f"{what}: not a readable torch file of tensors ({first})") from None
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{what}: expected a dict of tensors keyed by parameter name")
    return sd


def write_file(
    path: Path,
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    metadata: dict[str, str] | None,
    fill: Any,
    batch_bytes: int = 512 << 20,
) -> None:
    """Write a safetensors file of the tensors `specs` describes, a batch of keys at a time
    (`fill(keys)` gives their tensors), so that one process holds a batch, not the file;
    atomically: a temporary file, fsync'd, then renamed into place."""
    head, offsets, size = layout(specs, metadata)
    tmp = path.with_name(path.name + ".tmp")
    create(tmp, head, size)
    try:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            batch: list[str] = []
            held = 0
            for i, key in enumerate(specs):
                dtype, shape = specs[key]
                batch.append(key)
                held += math.prod(shape) * dtype.itemsize
                if held >= batch_bytes or i == len(specs) - 1:
                    for k, t in fill(batch).items():
                        write_at(fd, t, offsets[k])
                    batch, held = [], 0
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
