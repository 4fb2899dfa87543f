"""Reading DCP checkpoints: the storage reader that resume, `checkpoint.init_from` and
composerun-ckpt load through.

`SafeReader` is DCP's FileSystemReader, changed in three ways:

- `.metadata` (a pickle) is unpickled through an allow-list: nothing is imported but DCP's
  own record classes (dataclasses and enums, new ones too) and what torch's weights_only
  loading allows (composerun._torch_compat.load_dcp_metadata).
- Tensors go straight from the file into their destination.  DCP's own reader runs
  torch.load on each stored item, which allocates a temporary tensor, then copies that into
  the destination.  Here, when an item is a whole tensor stored the way `torch.save` writes
  one (an uncompressed zip record in this machine's byte order, contiguous, nothing else in
  its storage), and the destination is a contiguous CPU tensor of the same dtype and shape,
  the bytes are read into the destination's memory with one read.  The record's place
  comes from the item's own zip directory (composerun._torch_compat.tensor_record_offset),
  and dtype and shape from torch.load onto the meta device (weights_only: no data is read,
  nothing is unpickled beyond tensors).  Where each item lies comes from DCP's per-item
  storage records (composerun._torch_compat.item_locations).
  Anything else takes DCP's path: a stored tensor needed only in part (another world size,
  where shards do not line up), a GPU or strided destination, DCP's stream transforms.
- Items are read in file order, and the kernel is told up front (posix_fadvise WILLNEED)
  about every item's small records, so a cold disk sees reads in order instead of a seek
  back and forth for each item.
- The files named in `checksums` are hashed as they are read: every byte, in file order
  (the items' own records, and whatever lies between and after the items this rank loads,
  read for the purpose), each piece right after it was read, while it is still in the CPU's
  cache.  `digests` then holds each such file's checksum, for the caller to compare with the
  manifest; a file the plan does not read at all, or reads a part of twice, gets none (the
  caller reads and hashes it then).  A resume that checked the files in a pass of its own after the
  load read each rank's share of the checkpoint from the page cache a second time.

`prefetch` reads a checkpoint's files into the page cache in the background; resume starts
it once the small files are checked, so that a cold disk reads while the optimizer's state
is being built.

What the reader and the prefetch save a warm and a cold resume: BENCHMARKS.md's appendix.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from composerun._torch_compat import ItemLocation, item_locations, load_dcp_metadata, tensor_record_offset
from composerun.checkpoint.writer import CHECKSUMS
from composerun.errors import CheckpointError

_HINT = 1 << 16  # bytes at each end of an item that hold its zip records (pickle, directory)
_PREFETCH_CHUNK = 8 << 20  # Linux reads ahead at most a few MiB per WILLNEED call: ask in chunks
_HASH_CHUNK = 4 << 20  # bytes read then hashed at a time: they are still in the CPU's cache


class _Item(io.RawIOBase):
    """One stored item: a read-only, seekable window [start, start + length) of an open file."""

    def __init__(self, f: io.FileIO, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readall(self) -> bytearray:  # in one read, not RawIOBase's 8 KiB at a time
        buf = bytearray(self._length - self._pos)
        done = 0
        while done < len(buf):
            got = self.readinto(memoryview(buf)[done:])
            if not got:
                break
            done += got
        del buf[done:]
        return buf

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n]) or 0
        self._pos += got
        return got


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _data_offset(item: _Item, req: ReadItem, target: torch.Tensor) -> int | None:
    """Where, in the item, the raw bytes of `target` start, when the item is exactly `target`'s
    contents in torch.save's plain layout; None when it is not (DCP's path reads it then)."""
    plain = type(target) is torch.Tensor and not (target.is_conj() or target.is_neg())
    if not (plain and target.device.type == "cpu" and target.is_contiguous() and target.numel() > 0):
        return None
    meta = torch.load(item, map_location="meta", weights_only=True)
    if not isinstance(meta, torch.Tensor) or meta.dtype != target.dtype or meta.shape != target.shape:
        return None
    if meta.is_conj() or meta.is_neg():  # lazily conjugated or negated: the bytes are not the values
        return None
    nbytes = meta.numel() * meta.element_size()
    if any(o != 0 for o in req.storage_offsets) or list(req.lengths) != list(meta.shape):
        return None
    if not meta.is_contiguous() or meta.storage_offset() != 0 or meta.untyped_storage().nbytes() != nbytes:
        return None
    return tensor_record_offset(item, nbytes)


def _read_exactly(f: io.FileIO, start: int, view: memoryview, path: Path, hasher: _FileHash | None = None) -> None:
    f.seek(start)
    done = 0
    while done < len(view):
        piece = view[done : done + _HASH_CHUNK] if hasher is not None else view[done:]
        got = f.readinto(piece)
        if not got:
            raise CheckpointError(f"{path}: ends {len(view) - done} bytes early; the checkpoint is truncated")
        if hasher is not None:
            hasher.update(piece[:got])
        done += got


class _FileHash:
    """The checksum of one file, fed in file order: `upto` hashes (reading them) the bytes
    between what was hashed so far and an offset, `update` takes bytes the caller has read.
    `ok` turns False if the reads ever go back (two items over the same bytes): the digest
    would not be the file's, so it is given up."""

    def __init__(self, algorithm: str) -> None:
        self._h = CHECKSUMS[algorithm]()
        self.pos = 0
        self.ok = True

    def upto(self, f: io.FileIO, offset: int, path: Path) -> None:
        if offset < self.pos:
            self.ok = False
        buf = None
        while self.ok and self.pos < offset:
            n = min(offset - self.pos, _HASH_CHUNK)
            buf = buf if buf is not None else bytearray(n)  # the first piece is the largest
            view = memoryview(buf)[:n]
            _read_exactly(f, self.pos, view, path)
            self.update(view)

    def update(self, view: memoryview | bytes) -> None:
        if self.ok:
            self._h.update(view)
            self.pos += len(view)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled through an allow-list and whose tensors
    are read into their destinations directly (see the module's docstring).  `bytes_direct`
    and `bytes_copied` count the tensor bytes each way took.  `checksums` ({file name:
    algorithm}) names the files to hash while reading them; `digests` gets their checksums."""

    def __init__(self, path: str | os.PathLike, checksums: dict[str, str] | None = None) -> None:
        super().__init__(path)
        self.bytes_direct = self.bytes_copied = 0
        self.checksums = dict(checksums or {})
        self.digests: dict[str, str] = {}
        self.locations: dict[Any, ItemLocation] = {}  # where each stored item lies (set up from the metadata)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # DCP asks for a rank's own `__R.metadata` when a checkpoint has no global one
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = load_dcp_metadata(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, ImportError, IndexError) as e:
            raise CheckpointError(f"{path}: not valid DCP metadata ({e.__class__.__name__}: {e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if metadata.planner_data is None:
            metadata.planner_data = {}
        return metadata

    def set_up_storage_reader(self, metadata: Any, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)
        self.locations = item_locations(metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(self.locations[r.storage_index].transformed for r in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.locations[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: self.locations[r.storage_index].offset)
            self._read_file(Path(self.path) / relative_path, reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, path: Path, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        algorithm = self.checksums.get(path.name)
        hasher = _FileHash(algorithm) if algorithm else None
        with open(path, "rb", buffering=0) as f:
            self._check_length(path, os.fstat(f.fileno()).st_size, reqs)
            if hasattr(os, "posix_fadvise"):
                for req in reqs:
                    info = self.locations[req.storage_index]
                    n = min(info.length, _HINT)
                    os.posix_fadvise(f.fileno(), info.offset, n, os.POSIX_FADV_WILLNEED)
                    os.posix_fadvise(f.fileno(), info.offset + info.length - n, n, os.POSIX_FADV_WILLNEED)
            for req in reqs:
                info = self.locations[req.storage_index]
                if hasher is not None:
                    hasher.upto(f, info.offset, path)  # what lies before the item
                item = _Item(f, info.offset, info.length)
                if req.type == LoadItemType.BYTE_IO:
                    raw = item.read()
                    if hasher is not None:
                        hasher.update(raw)
                    planner.load_bytes(req, io.BytesIO(raw))
                    continue
                target = planner.resolve_tensor(req).detach()
                start = _data_offset(item, req, target)
                if start is not None:
                    if hasher is not None:
                        hasher.upto(f, info.offset + start, path)  # the item's records before its data
                    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                    _read_exactly(f, info.offset + start, view, path, hasher)
                    torch.autograd.graph.increment_version(target)  # an in-place write, as copy_ would count
                    self.bytes_direct += len(view)
                else:
                    item.seek(0)
                    if hasher is not None:  # read the item once: for the checksum and for torch.load
                        raw = item.read()
                        hasher.update(raw)
                        item = io.BytesIO(raw)
                    tensor = torch.load(item, map_location="cpu", weights_only=True)
                    tensor = _narrow(tensor, req.storage_offsets, req.lengths)
                    if tensor.size() != target.size():
                        raise CheckpointError(
                            f"{path}: {req.storage_index.fqn} has shape {tuple(tensor.size())}, expected {tuple(target.size())}"
                        )
                    target.copy_(tensor)
                    self.bytes_copied += tensor.numel() * tensor.element_size()
                planner.commit_tensor(req, target)
            if hasher is not None:
                hasher.upto(f, os.fstat(f.fileno()).st_size, path)  # what lies after the last item
                if hasher.ok:
                    self.digests[path.name] = hasher.hexdigest()

    def _check_length(self, path: Path, size: int, reqs: list[ReadItem]) -> None:
        """Every item the plan reads lies inside the file: a truncated file is refused here,
        in one line, before torch reads an item's zip records (its own error then says only
        "failed finding central directory")."""
        last = max(reqs, key=lambda r: self.locations[r.storage_index].end)
        end = self.locations[last.storage_index].end
        if end > size:
            raise CheckpointError(
                f"{path}: ends {end - size} bytes early ({last.storage_index.fqn} is stored up to byte {end}); the "
                "checkpoint is truncated: use another checkpoint, or copy this one again"
            )


def stored_shapes(ckpt: Path, entry: str) -> dict[str, tuple[int, ...] | None]:
    """FQNs stored under a top-level entry (`model`, ...) and each one's global shape (None
    for what is not a tensor), from the (safe) metadata."""
    md = SafeReader(str(ckpt)).read_metadata()
    return {
        k[len(entry) + 1 :]: (tuple(v.size) if hasattr(v, "size") else None)
        for k, v in md.state_dict_metadata.items()
        if k.startswith(entry + ".")
    }


def stored_ranks(ckpt: Path) -> set[int]:
    """The ranks whose RNG state the checkpoint holds (`rng.rank<R>...` keys): the world size
    of the run that saved it."""
    md = SafeReader(str(ckpt)).read_metadata()
    found = (re.match(r"rng\.rank(\d+)\.", k) for k in md.state_dict_metadata)
    return {int(m.group(1)) for m in found if m}


def prefetch(paths: list[Path]) -> threading.Thread | None:
    """Ask the kernel to read `paths` into the page cache, in the background (a daemon thread
    that asks, chunk by chunk, with posix_fadvise WILLNEED; the kernel does the reading).
    Resume starts it before building the optimizer's state, so a cold disk reads while the
    CPU works.  Only a hint: errors are ignored, and without posix_fadvise it does nothing."""
    if not hasattr(os, "posix_fadvise") or not paths:
        return None

    def run() -> None:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                for offset in range(0, size, _PREFETCH_CHUNK):
                    os.posix_fadvise(fd, offset, _PREFETCH_CHUNK, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=run, name="composerun-prefetch", daemon=True)
    thread.start()
    return thread
