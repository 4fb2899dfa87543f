"""The contract of composerun/_torch_compat.py's checkpoint part, pinned against the installed
torch (one process, no group): what composerun's checkpoint writer and reader rely on in DCP
and torch.save beyond their documented API.  A torch release that changes one of these
fails here, with the assertion naming what changed, before a save or a resume does.

- DCP's FileSystemWriter writes every file of a save through its `fs`, front to back, and
  renames through it (use_file_system: the checksums while writing depend on it).
- torch.save's zip records carry no CRC-32 while no_zip_crc32 is held, torch.load reads
  them, and torch's process-wide setting comes back (and is counted across threads).
- DCP's per-item storage records say where each item lies (item_locations).
- torch.save's layout for one tensor: one uncompressed storage record, a byteorder record
  (tensor_record_offset: the reader reads tensors straight into place from there).
- DCP's `.metadata` unpickles through load_dcp_metadata, which takes every record class DCP
  defines (new ones too) and torch's safe globals, and refuses anything else.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
import zipfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from composerun import _torch_compat as compat

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(40, 30, generator=g),
        "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "hparams": {"lr": 0.25},  # not a tensor: DCP stores it as bytes
    }


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[dict, Path]:
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    return state, tmp_path / "ckpt"


def _metadata(path: Path):
    with open(path / ".metadata", "rb") as f:
        return compat.load_dcp_metadata(f)


# --- the writer's file system ---------------------------------------------------------------


class _Recorded(io.RawIOBase):
    """A stream for writing that records the calls DCP makes on it and refuses to seek."""

    def __init__(self, f, calls: list[str]) -> None:
        self._f, self.calls, self.nbytes = f, calls, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.calls.append("write")
        n = self._f.write(b)
        self.nbytes += n
        return n

    def tell(self) -> int:
        self.calls.append("tell")
        assert self._f.tell() == self.nbytes  # only ever at the end of what was written
        return self.nbytes

    def seek(self, *args) -> int:
        self.calls.append("seek")
        raise io.UnsupportedOperation("written front to back")

    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        self._f.flush()


class _RecordingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.created: dict[str, str] = {}  # name: mode
        self.calls: list[str] = []
        self.renamed: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode):
        with self._lock:
            self.created[Path(path).name] = mode
        with open(path, mode) as f:
            yield _Recorded(f, self.calls) if "w" in mode else f

    def rename(self, path, new_path) -> None:
        self.renamed[Path(path).name] = Path(new_path).name
        super().rename(path, new_path)


def test_dcp_writes_every_file_through_the_writers_file_system(tmp_path: Path) -> None:
    fs = _RecordingFileSystem()
    writer = FileSystemWriter(str(tmp_path / "ckpt"), thread_count=2)
    compat.use_file_system(writer, fs)
    dcp.save(_state(), storage_writer=writer)
    on_disk = {p.name for p in (tmp_path / "ckpt").iterdir()}
    written = {fs.renamed.get(name, name) for name, mode in fs.created.items() if "w" in mode}
    assert written == on_disk and ".metadata" in on_disk, (fs.created, fs.renamed, on_disk)
    assert all(mode == "wb" for mode in fs.created.values()), fs.created
    assert "write" in fs.calls and "seek" not in fs.calls  # front to back
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v) for k, v in _state().items()}
    dcp.load(got, checkpoint_id=str(tmp_path / "ckpt"))  # and the files are DCP's
    assert torch.equal(got["w"], _state()["w"]) and got["hparams"] == {"lr": 0.25}


def test_a_writer_without_a_file_system_fails_with_one_clear_error() -> None:
    with pytest.raises(compat.ComposerunTorchCompatError, match=r"object\.fs, a FileSystemBase.*torch 2\.\d+"):
        compat.use_file_system(object(), FileSystem())


# --- torch.save's CRC-32 switch -------------------------------------------------------------


def _crcs(t: torch.Tensor) -> list[int]:
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        crcs = [info.CRC for info in zf.infolist() if "/data/" in info.filename]
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), t)  # read either way
    return crcs


def test_no_zip_crc32_leaves_them_out_and_torchs_setting_comes_back() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    assert torch.serialization.get_crc32_options() is True
    assert all(_crcs(t))
    with compat.no_zip_crc32():
        assert _crcs(t) == [0]
    assert torch.serialization.get_crc32_options() is True and all(_crcs(t))
    torch.serialization.set_crc32_options(False)
    try:  # a setting of the user's own is kept too
        with compat.no_zip_crc32():
            pass
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)


def test_no_zip_crc32_stays_off_until_the_last_user_leaves() -> None:
    with compat.no_zip_crc32():
        with compat.no_zip_crc32():  # two files at once (DCP's writer threads, an async save)
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is False
    assert torch.serialization.get_crc32_options() is True


# --- where DCP stored each item -------------------------------------------------------------


def test_item_locations_hold_each_item_as_torch_save_wrote_it(saved) -> None:
    state, path = saved
    locations = compat.item_locations(_metadata(path))
    assert {index.fqn for index in locations} == {"w", "half", "scalar", "hparams.lr"}
    by_file: dict[str, list[compat.ItemLocation]] = {}
    for index, loc in locations.items():
        assert not loc.transformed
        raw = (path / loc.relative_path).read_bytes()
        assert 0 <= loc.offset and loc.end == loc.offset + loc.length <= len(raw), (index, loc)
        item = raw[loc.offset : loc.end]
        if index.fqn in state:  # a tensor: torch.save's bytes, whole
            assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), state[index.fqn]), index
        by_file.setdefault(loc.relative_path, []).append(loc)
    for locs in by_file.values():  # one after another, none overlapping
        locs.sort(key=lambda loc: loc.offset)
        assert all(a.end <= b.offset for a, b in zip(locs, locs[1:], strict=False))


def test_item_locations_refuse_records_they_cannot_read() -> None:
    class Odd:
        storage_data = {"x": ("__0_0.distcp", 0, 10)}  # a torch whose records changed shape

    with pytest.raises(compat.ComposerunTorchCompatError, match="storage_data holds tuple"):
        compat.item_locations(Odd())
    assert compat.item_locations(object()) == {}


# --- torch.save's layout for one tensor -----------------------------------------------------


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("crc32", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensor_record_offset_points_at_the_tensors_bytes(dtype, crc32: bool) -> None:
    t = (torch.arange(257) % 3).to(dtype)
    with compat.no_zip_crc32() if not crc32 else nullcontext():
        buf = _saved(t)
    nbytes = t.numel() * t.element_size()
    at = compat.tensor_record_offset(buf, nbytes)
    assert at is not None
    assert buf.getvalue()[at : at + nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensor_record_offset_refuses_what_is_not_one_plain_tensor() -> None:
    t = torch.arange(100, dtype=torch.float32)
    assert compat.tensor_record_offset(_saved(t[10:20]), 40) is None  # the whole storage is saved: 400 bytes
    assert compat.tensor_record_offset(_saved({"a": t, "b": t + 1}), 400) is None  # two records
    assert compat.tensor_record_offset(io.BytesIO(b"not a zip file at all"), 4) is None


def test_tensor_record_offset_finds_dcps_items(saved) -> None:
    state, path = saved
    for index, loc in compat.item_locations(_metadata(path)).items():
        if index.fqn not in state:
            continue
        t = state[index.fqn]
        item = io.BytesIO((path / loc.relative_path).read_bytes()[loc.offset : loc.end])
        at = compat.tensor_record_offset(item, t.numel() * t.element_size())
        assert at is not None, index
        assert (
            item.getvalue()[at : at + t.numel() * t.element_size()] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
        )


# --- DCP's .metadata ------------------------------------------------------------------------


def test_dcp_metadata_loads_as_pickle_would(saved) -> None:
    _, path = saved
    with open(path / ".metadata", "rb") as f:
        plain = pickle.load(f)
    ours = _metadata(path)
    assert ours == plain  # DCP's Metadata is a dataclass: compared field by field


def _refused(obj) -> str:
    with pytest.raises(pickle.UnpicklingError) as info:
        compat.load_dcp_metadata(io.BytesIO(pickle.dumps(obj)))
    message = str(info.value)
    assert "is not allowed in DCP metadata" in message and "\n" not in message
    return message


def test_dcp_metadata_refuses_what_is_not_a_dcp_record() -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed|os.system is not allowed"):
        compat.load_dcp_metadata(io.BytesIO(b"cos\nsystem\n(S'echo pwned'\ntR."))
    assert _refused(Path).startswith("pathlib.Path ")  # a class outside the allow-list
    assert _refused(FileSystemWriter).startswith("torch.distributed.checkpoint.filesystem.FileSystemWriter ")
    assert _refused(save).startswith("torch.distributed.checkpoint.state_dict_saver.save ")  # a function
    from torch.distributed.checkpoint._async_process_executor import _ProcessGroupInitInfo

    assert not _ProcessGroupInitInfo.__dataclass_params__.init  # a dataclass with an __init__ of its own
    _refused(_ProcessGroupInitInfo)


def test_dcp_metadata_takes_a_record_class_dcp_adds(monkeypatch) -> None:
    """A torch release that adds a record class to what it pickles (as _StorageInfo came into
    filesystem.py) does not break resume: every DCP module's dataclasses are taken."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    @dataclasses.dataclass
    class _NewStorageInfo:
        relative_path: str
        offsets: torch.Size = torch.Size([])

    _NewStorageInfo.__module__, _NewStorageInfo.__qualname__ = dcp_filesystem.__name__, "_NewStorageInfo"
    monkeypatch.setattr(dcp_filesystem, "_NewStorageInfo", _NewStorageInfo, raising=False)
    record = {"x": _NewStorageInfo("__0_0.distcp", torch.Size([2, 3])), "m": dcp_metadata.MetadataIndex("x")}
    assert compat.load_dcp_metadata(io.BytesIO(pickle.dumps(record))) == record


@dataclasses.dataclass
class UserRecord:
    value: int


def test_dcp_metadata_takes_torchs_safe_globals_the_user_adds() -> None:
    raw = pickle.dumps(UserRecord(3))
    _refused(UserRecord(3))
    with torch.serialization.safe_globals([UserRecord]):
        assert compat.load_dcp_metadata(io.BytesIO(raw)) == UserRecord(3)
