"""The DCP checkpoint files' undocumented parts composerun's writer and reader rely on (DCP's
writer's file system, its per-item storage records, torch.save's zip layout and CRC-32 switch,
what DCP pickles into `.metadata`): pinned by tests/test_compat.py."""

from __future__ import annotations

import dataclasses
import enum
import pickle
import struct
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, NamedTuple

import torch

from composerun._torch_compat._base import ComposerunTorchCompatError, _require, tested

_DCP = "torch.distributed.checkpoint"
# torch's own allow-list of the weights_only unpickler ({"module.name": object}): torch.Size,
# every dtype, torch.serialization._get_layout, OrderedDict, ... (what torch itself pickles)
_torch_weights_only_globals = _require("torch._weights_only_unpickler", "_get_allowed_globals")


def use_file_system(writer: Any, fs: Any) -> None:
    """Have DCP's FileSystemWriter write every file of a save (data files, `.metadata`)
    through `fs`, a torch.distributed.checkpoint.FileSystemBase, and rename through it.
    The writer keeps its file system in its `fs` attribute (DCP's own fsspec writer sets
    its own there); that attribute is not documented, so it is checked before it is set."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    if not isinstance(getattr(writer, "fs", None), FileSystemBase):
        raise ComposerunTorchCompatError(
            f"composerun writes checkpoints through {type(writer).__name__}.fs, a FileSystemBase, which "
            f"torch {torch.__version__} no longer has (tested with torch {tested()})"
        )
    writer.fs = fs


_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextmanager
def no_zip_crc32() -> Iterator[None]:
    """torch.save writes no CRC-32 into its zip records while any caller is inside (DCP's
    writer threads and an async save's thread may be at once: they are counted), and torch's
    setting as it was found comes back when the last one leaves.  torch's switch
    (torch.serialization.set_crc32_options) is process-wide: a torch.save elsewhere in the
    process meanwhile writes none either; torch.load reads files with and without."""
    global _crc_users, _crc_before
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_before)


class ItemLocation(NamedTuple):
    """Where DCP stored one item: a byte range of one file of the checkpoint folder."""

    relative_path: str
    offset: int
    length: int
    transformed: bool  # written through DCP's stream transforms: not torch.save's bytes as they are

    @property
    def end(self) -> int:
        return self.offset + self.length


def item_locations(metadata: Any) -> dict[Any, ItemLocation]:
    """{MetadataIndex: ItemLocation} of every stored item, from the metadata's `storage_data`,
    whose values are DCP's private _StorageInfo records (filesystem.py)."""
    out = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        try:
            path, offset, length = info.relative_path, info.offset, info.length
            out[index] = ItemLocation(str(path), int(offset), int(length), bool(info.transform_descriptors))
        except (AttributeError, TypeError, ValueError):
            raise ComposerunTorchCompatError(
                f"DCP metadata's storage_data holds {type(info).__name__}, not the records of (relative_path, "
                f"offset, length, transform_descriptors) composerun reads (torch {torch.__version__}, "
                f"tested with torch {tested()})"
            ) from None
    return out


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... name and extra lengths


def tensor_record_offset(item: IO[bytes], nbytes: int) -> int | None:
    """Where the raw bytes of a tensor start in `item`, a seekable stream holding what
    torch.save wrote for one tensor, when they lie there as they are in memory: the archive
    holds one storage record (`<archive>/data/<key>`) of exactly `nbytes`, stored
    uncompressed, and its `<archive>/byteorder` record is this machine's.  None otherwise
    (the caller reads the item through torch.load then).  The zip directory is read with
    zipfile and the record's local header by hand, not with zipfile's read(), which tests a
    CRC-32 that composerun's saves leave out (no_zip_crc32)."""
    item.seek(0)
    try:
        zf = zipfile.ZipFile(item)
    except zipfile.BadZipFile:
        return None
    names = zf.namelist()
    root = names[0].split("/", 1)[0] if names else ""
    records = [n for n in names if n.startswith(f"{root}/data/")]
    if len(records) != 1 or f"{root}/byteorder" not in names:
        return None
    order_info = zf.getinfo(f"{root}/byteorder")
    order = _record_start(item, order_info)
    if order is None:
        return None
    item.seek(order)
    if item.read(order_info.file_size) != sys.byteorder.encode():
        return None
    info = zf.getinfo(records[0])
    return _record_start(item, info) if info.file_size == nbytes else None


def _record_start(item: IO[bytes], info: zipfile.ZipInfo) -> int | None:
    """Where a stored (uncompressed) zip record's bytes start: after its local header."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    item.seek(info.header_offset)
    header = item.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


# Outside torch: the checkpoint's id (a path) and containers DCP's records may hold.
_METADATA_GLOBALS = {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")} | {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("collections", "OrderedDict"),
}


def _is_dcp_record(obj: Any) -> bool:
    """A class DCP defines to hold data: an Enum, or a dataclass whose __init__ is the one
    dataclasses writes (it only stores its fields).  DCP's metadata classes are all such,
    new ones too; its writers, readers and functions are not."""
    if not isinstance(obj, type) or not str(obj.__module__).startswith(_DCP + "."):
        return False
    if issubclass(obj, enum.Enum):
        return True
    params = getattr(obj, "__dataclass_params__", None)
    return dataclasses.is_dataclass(obj) and params is not None and params.init


class _MetadataUnpickler(pickle.Unpickler):
    """Imports nothing but DCP's record classes (_is_dcp_record), the globals torch's own
    weights_only loading allows (its built-in list and torch.serialization.add_safe_globals'),
    and a few of Python's (_METADATA_GLOBALS)."""

    def __init__(self, f: IO[bytes]) -> None:
        super().__init__(f)
        self.allowed = set(_torch_weights_only_globals())
        for g in torch.serialization.get_safe_globals():  # objects, or (object, "module.name")
            self.allowed.add(g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}")

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP + ".") or module == _DCP:
            obj = super().find_class(module, name)  # (importing a module of torch's own)
            if _is_dcp_record(obj):
                return obj
        elif (module, name) in _METADATA_GLOBALS or f"{module}.{name}" in self.allowed:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in DCP metadata (only DCP's record classes and torch's safe "
            "globals are; to trust it, torch.serialization.add_safe_globals)"
        )


def load_dcp_metadata(f: IO[bytes]) -> Any:
    """DCP's `.metadata` (a pickle of its Metadata), unpickled without importing anything
    else: a damaged or hostile file raises pickle.UnpicklingError (or what a broken pickle
    raises: EOFError, ValueError, ...) instead of running code.  DCP's own reader unpickles
    it with pickle.load, which imports whatever the file names."""
    return _MetadataUnpickler(f).load()
