"""Writing DCP checkpoints: the file system composerun's saves write through.

`HashingFileSystem` is DCP's local file system (FileSystemWriter's `fs`, set through
composerun._torch_compat.use_file_system), changed in three ways; the files stay what DCP
writes and torch alone reads them (`dcp.load`, `torch.load`):

- Every byte written is fed to the checkpoint's checksum (xxh3_128, or sha256), so the
  manifest gets every file's checksum without reading anything back.
- No CRC32 in the files' zip records (unless `checkpoint.zip_crc32=true`).  DCP stores each
  tensor with `torch.save`, whose zip records carry a CRC32 that torch computes at about
  1.5-3 GiB/s on one core here: a save of 768 MiB from one process took 1.42x as long with
  them (1.34-1.50 over 5 pairs, `scripts/bench_crc.py`).  The manifest's checksum already
  covers every byte of every file (and is checked on resume), so the CRC32 is redundant for
  composerun, torch.load and dcp.load; what it breaks is tools that read the files as zip
  archives and test their CRCs (Python's zipfile reading a record, `unzip -t`).  torch's
  setting is process-wide (composerun._torch_compat.no_zip_crc32): it is off while any
  composerun file is open for writing and restored when the last one closes.
- How the bytes reach the disk, three ways:
  - Plain buffered writes (the default): into the page cache, written out by the kernel
    as it sees fit and at the fsync when the file closes.  On a shared file system
    (Lustre, GPFS, NFS) the client gathers dirty pages into large RPCs and keeps several in
    flight; nothing here waits for the servers before the fsync.
  - A page cache of bounded size (`bounded_cache=True`, `checkpoint.bounded_cache=true`):
    each 32 MiB written is handed to the kernel's writeback at once (`sync_file_range`,
    Linux), so the disk writes while the rest is serialised; the range handed over the
    time before is then waited for and its pages dropped (posix_fadvise DONTNEED).  A file
    being written holds about 64 MiB of page cache, not its whole size, and the same pages
    come back for the next ranges: on a VM's local disk that was the fastest way (fresh
    memory is the slowest memory a VM gets).  On a shared file system each wait is a
    round trip to the servers every 32 MiB, the stream stalling behind it (reasoned, not
    measured: there is none here): not the default.
  - Direct I/O (`direct=True`, `checkpoint.direct_io=true`): where the file system takes
    O_DIRECT, the bytes are copied into an aligned 16 MiB buffer and written from it
    straight to the disk, bypassing the page cache; the last partial block is padded and
    the file cut back to its length.  Where it does not (tmpfs, some network file systems),
    one of the two ways above.
  Every file is fsync'd when it closes (DCP's own fsync, then close's).

Which way is faster depends on the disk: BENCHMARKS.md measures the three ways ("Plain
buffered writes against the bounded page cache", and its appendix for the machines before).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import mmap
import os
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from composerun._torch_compat import no_zip_crc32, use_file_system

# The checksum algorithms a manifest may name (a file's entry holds one of them by name).
CHECKSUMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_WRITEBACK = 32 << 20  # bytes written between two writeback requests (the bounded page cache)
_DIRECT_CHUNK = 16 << 20  # bytes per direct write
_DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of the disk's block size
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4  # <fcntl.h>


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing [offset, offset + nbytes) of `fd` out to the disk,
    without waiting for it.  False where that cannot be asked (the fsync then does it all)."""
    if _sync_file_range is None:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def finish_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Wait until [offset, offset + nbytes) of `fd` is on the disk (writing what is not yet
    under way), then drop its pages from the page cache.  False where that cannot be asked
    (the fsync then does it all, and the pages stay).  nbytes 0 means to the end of the file."""
    if _sync_file_range is None or not hasattr(os, "posix_fadvise"):
        return False
    flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        return False
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    return True


class _HashingStream(io.RawIOBase):
    """A file opened for writing that feeds every byte written to a checksum.  DCP writes each
    file front to back (write/tell/flush/fileno, then close), so the digest is the file's.

    Through the page cache, plain writes; with `bounded`, each 32 MiB is handed to the
    kernel's writeback as soon as it is written, and the 32 MiB before it waited for and
    dropped; with `direct` (where the file system takes O_DIRECT) the bytes go through an
    aligned buffer straight to the disk.  close() makes the file durable each way (DCP's own
    fsync comes before close, when a direct file's last partial block is still in the buffer)."""

    def __init__(self, path: str | os.PathLike, algorithm: str, direct: bool = False, bounded: bool = False) -> None:
        self._h, self.nbytes, self.bounded = CHECKSUMS[algorithm](), 0, bounded
        self._buf = mmap.mmap(-1, _DIRECT_CHUNK) if direct else None  # page-aligned
        self._fd = _open_direct(path) if self._buf is not None else None
        self.direct = self._fd is not None
        if self._fd is None:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.error: OSError | None = None  # the first failed write
        self._fill = 0  # bytes waiting in _buf (direct)
        self._on_file = 0  # the file offset of _buf[0]
        self._written_back = 0  # bytes before this offset were handed to writeback (bounded)
        self._dropped = 0  # bytes before this offset are on the disk and out of the page cache

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b)
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
        self._h.update(view)
        try:
            if self.direct:
                self._write_direct(view)
            else:
                self._write_buffered(view)
        except OSError as e:  # a full disk, say: kept, for the error the save reports
            self.error = e
            raise
        self.nbytes += len(view)
        return len(view)

    def _write_direct(self, view: memoryview) -> None:
        at = 0
        while at < len(view):
            n = min(len(view) - at, _DIRECT_CHUNK - self._fill)
            self._buf[self._fill : self._fill + n] = view[at : at + n]
            self._fill += n
            at += n
            if self._fill == _DIRECT_CHUNK:
                self._flush_direct(_DIRECT_CHUNK)
                if not self.direct:  # the rest of this write goes the page-cache way
                    self._write_buffered(view[at:])
                    return

    def _flush_direct(self, nbytes: int) -> None:
        """Write the first nbytes of the buffer (_fill bytes, padded to whole blocks).  A file
        system that took O_DIRECT at open but refuses these writes (blocks larger than 4 KiB)
        gets them through the page cache instead, and so does the rest of the file."""
        try:
            _write_all(self._fd, memoryview(self._buf)[:nbytes])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            import fcntl

            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            done = os.lseek(self._fd, 0, os.SEEK_CUR) - self._on_file  # what got through
            _write_all(self._fd, memoryview(self._buf)[done : self._fill])
        self._on_file += self._fill  # (padding past it is cut off by close's ftruncate)
        self._fill = 0

    def _write_buffered(self, view: memoryview) -> None:
        _write_all(self._fd, view)
        end = self.nbytes + len(view)
        if self.bounded and end - self._written_back >= _WRITEBACK:
            start_writeback(self._fd, self._written_back, end - self._written_back)
            # the range handed over the time before has had this one's writing to get out
            before = self._written_back - self._dropped  # (0 would mean "to the end of the file")
            if before and finish_writeback(self._fd, self._dropped, before):
                self._dropped = self._written_back
            self._written_back = end

    def tell(self) -> int:
        return self.nbytes

    def seek(self, *args: Any) -> int:  # a writer that seeks would make the digest wrong
        raise io.UnsupportedOperation("checksummed checkpoint files are written front to back")

    def flush(self) -> None:
        pass  # nothing is held back but a direct file's last partial block, written by close()

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Write what is left, cut a direct file back to its length, fsync, close."""
        if self.closed:
            return
        try:
            if self.direct and self._fill:
                # O_DIRECT writes whole blocks: pad the last one, then cut the file to its length
                padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
                self._buf[self._fill : padded] = bytes(padded - self._fill)
                self._flush_direct(padded)
            os.ftruncate(self._fd, self.nbytes)
            os.fsync(self._fd)
            if (self.bounded or self._buf is not None) and hasattr(os, "posix_fadvise"):
                # on the disk now: the pages it still has go (plain writes leave them to the kernel)
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without finishing: a write failed (the file is never published)."""
        if self.closed:
            return
        os.close(self._fd)
        if self._buf is not None:
            self._buf.close()
        super().close()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _open_direct(path: str | os.PathLike) -> int | None:
    """An O_DIRECT descriptor for a new file at path, or None where the file system (tmpfs,
    some network ones) or the platform has no direct I/O."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording {name: {bytes, <algorithm>}} of every file this rank
    writes (DCP's writer threads, or the async save's thread; renames follow).  `direct`:
    write with O_DIRECT where the file system has it; `bounded_cache`: write through a page
    cache of bounded size, not plain buffered writes; `crc32`: keep torch.save's CRC-32s in
    the zip records (see the module's docstring)."""

    def __init__(self, algorithm: str, direct: bool = False, crc32: bool = False, bounded_cache: bool = False) -> None:
        super().__init__()
        self.algorithm, self.direct, self.crc32, self.bounded_cache = algorithm, direct, crc32, bounded_cache
        self.files: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def install(self, writer: Any) -> HashingFileSystem:
        """Make DCP's FileSystemWriter `writer` write through this file system; returns it."""
        use_file_system(writer, self)
        return self

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with no_zip_crc32() if not self.crc32 else nullcontext():
            stream = _HashingStream(path, self.algorithm, self.direct, self.bounded_cache)
            try:
                yield stream
            except BaseException as e:
                stream.abort()
                if stream.error is not None and not isinstance(e, OSError):
                    # torch's zip writer turns a failed write into "unexpected pos": say why it failed
                    e.composerun_os_error = stream.error
                raise
            stream.close()  # DCP has closed it already, after its fsync
        with self._lock:
            self.files[Path(path).name] = {"bytes": stream.nbytes, self.algorithm: stream.hexdigest()}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.files:
                self.files[Path(new_path).name] = self.files.pop(Path(path).name)
