"""composerun.checkpoint.writer.HashingFileSystem under a plain DCP save (one process, no group): the files
are DCP's, readable by torch alone, with no CRC32s, checksummed as written; plain buffered
writes by default, a page cache of bounded size or O_DIRECT when asked for, and
`checkpoint.bounded_cache` reaching the ranks' writer.  The publish order of a real save
(one rank): every file fsync'd, then the rename to step-N, then `latest`, then checkpoints/ fsync'd."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, compose, train
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from composerun.checkpoint import writer
from composerun.checkpoint.manifest import file_checksum
from composerun.checkpoint.reader import SafeReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 100, generator=g),  # 120 KB: several writeback ranges at 16 KiB
        "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "scalar": torch.tensor(3.5),
        "hparams": {"lr": 0.25},  # not a tensor: DCP stores it as bytes
    }


# the three ways to the disk: HashingFileSystem's (direct, bounded_cache)
WAYS = {"plain": (False, False), "bounded": (False, True), "direct": (True, False)}


def _save(path: Path, state: dict, algorithm: str = "xxh3_128", way: str = "plain") -> writer.HashingFileSystem:
    w = FileSystemWriter(str(path))
    direct, bounded = WAYS[way]
    fs = writer.HashingFileSystem(algorithm, direct, bounded_cache=bounded).install(w)
    dcp.save(state, storage_writer=w)
    return fs


def _like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v) for k, v in state.items()}


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_files_load_with_torch_alone_and_match_their_checksums(tmp_path: Path, algorithm: str, way: str) -> None:
    state = _state()
    fs = _save(tmp_path / "ckpt", state, algorithm, way)
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert set(fs.files) == files and ".metadata" in files
    for name, entry in fs.files.items():
        path = tmp_path / "ckpt" / name
        assert entry == {"bytes": path.stat().st_size, algorithm: file_checksum(path, algorithm)}
    for reader in (FileSystemReader, SafeReader):  # DCP's own reader, and composerun's
        got = _like(state)
        dcp.load(got, storage_reader=reader(str(tmp_path / "ckpt")))
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v) and got[k].dtype == v.dtype, (reader.__name__, k)
            else:
                assert got[k] == v


def test_no_crc32_in_the_files_and_torchs_setting_comes_back(tmp_path: Path) -> None:
    """torch.save's zip records carry a CRC32 by default; composerun's files carry none
    (the manifest's checksum covers every byte), and torch's own setting is left as found."""
    assert torch.serialization.get_crc32_options() is True
    _save(tmp_path / "ours", _state())
    assert torch.serialization.get_crc32_options() is True
    dcp.save(_state(), checkpoint_id=str(tmp_path / "plain"))

    def crcs(ckpt: Path) -> list[int]:
        # every data file holds one zip archive per tensor, one after another; each
        # archive's central directory has the CRC-32 of its records
        out = []
        for f in ckpt.glob("*.distcp"):
            raw = f.read_bytes()
            at = 0
            while (at := raw.find(b"PK\x01\x02", at)) >= 0:
                # central directory header: the CRC-32 is at byte 16, the name's length at 28
                crc = int.from_bytes(raw[at + 16 : at + 20], "little")
                name_len = int.from_bytes(raw[at + 28 : at + 30], "little")
                if raw[at + 46 : at + 46 + name_len].endswith(b"/data/0"):  # the tensor's bytes
                    out.append(crc)
                at += 4
        return out

    assert crcs(tmp_path / "plain") and all(crcs(tmp_path / "plain"))
    assert crcs(tmp_path / "ours") and not any(crcs(tmp_path / "ours"))
    torch.serialization.set_crc32_options(False)
    try:  # a setting of the user's own is kept too
        _save(tmp_path / "again", _state())
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)


def _watch_writeback(monkeypatch) -> tuple[list, list]:
    """The writeback requests a save makes, (fd, offset, nbytes) each; 16 KiB between two (32 MiB in use)."""
    started: list[tuple[int, int, int]] = []
    finished: list[tuple[int, int, int]] = []
    real_start, real_finish = writer.start_writeback, writer.finish_writeback
    monkeypatch.setattr(writer, "_WRITEBACK", 16 << 10)
    monkeypatch.setattr(
        writer, "start_writeback", lambda fd, off, n: started.append((fd, off, n)) or real_start(fd, off, n)
    )
    monkeypatch.setattr(
        writer, "finish_writeback", lambda fd, off, n: finished.append((fd, off, n)) or real_finish(fd, off, n)
    )
    return started, finished


def test_plain_writes_ask_for_no_writeback(tmp_path: Path, monkeypatch) -> None:
    """The default: the kernel writes the pages out as it sees fit (and at the fsync); nothing
    waits for the disk, or for a shared file system's servers, every 32 MiB."""
    started, finished = _watch_writeback(monkeypatch)
    fs = _save(tmp_path / "ckpt", _state())
    (data,) = (tmp_path / "ckpt").glob("*.distcp")
    assert data.stat().st_size > 4 * (16 << 10)  # several ranges' worth were written
    assert started == [] and finished == []
    assert fs.files[data.name]["xxh3_128"] == file_checksum(data, "xxh3_128")


def test_bounded_cache_asks_for_writeback_of_each_range_as_it_is_written(tmp_path: Path, monkeypatch) -> None:
    """bounded_cache: every 16 KiB (32 MiB in use) the range just written is handed to the
    kernel's writeback, and the range handed over before it is waited for and dropped:
    contiguous ranges from the start of the file, none past what was written, each dropped
    one behind the one started; the file and its checksum are the same as without."""
    started, finished = _watch_writeback(monkeypatch)
    fs = _save(tmp_path / "ckpt", _state(), way="bounded")
    (data,) = (tmp_path / "ckpt").glob("*.distcp")  # one rank: one data file; .metadata is < 16 KiB
    size = data.stat().st_size
    assert len({fd for fd, _, _ in started + finished}) == 1
    ranges = [(off, n) for _, off, n in started]
    assert ranges[0][0] == 0 and all(n >= 16 << 10 for _, n in ranges)
    assert all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous
    assert size - (16 << 10) < ranges[-1][0] + ranges[-1][1] <= size  # all but the tail: the fsync's
    # the first range is dropped when the second is started, and so on: one behind
    assert [(off, n) for _, off, n in finished] == ranges[:-1]
    assert fs.files[data.name]["xxh3_128"] == file_checksum(data, "xxh3_128")
    assert zipfile.is_zipfile(data)  # the last archive's directory ends the file


@pytest.mark.skipif(
    shutil.which("fincore") is None or not hasattr(os, "posix_fadvise"), reason="needs util-linux fincore"
)
@pytest.mark.parametrize("way", list(WAYS))
def test_only_plain_writes_leave_the_file_in_the_page_cache(tmp_path: Path, way: str) -> None:
    """The bounded cache writes out and drops as it goes, O_DIRECT never caches: a checkpoint
    does not take its size again in page cache.  Plain writes leave the pages to the kernel
    (clean once fsync'd: the first memory it takes back)."""
    state = {"big": torch.randn(6 << 20, generator=torch.Generator().manual_seed(0))}  # 24 MiB
    _skip_unless_pages_can_be_dropped(tmp_path)
    _save(tmp_path / "ckpt", state, way=way)
    (data,) = (tmp_path / "ckpt").glob("*.distcp")
    assert data.stat().st_size > 20 << 20
    if way == "plain":
        assert _resident(data) > 16 << 20
    else:
        assert _resident(data) == 0


@pytest.mark.skipif(
    shutil.which("fincore") is None or not hasattr(os, "posix_fadvise"), reason="needs util-linux fincore"
)
def test_checkpoint_bounded_cache_reaches_the_ranks_writer(tmp_path: Path) -> None:
    """Plain writes by default; `checkpoint.bounded_cache=true` on the command line reaches the
    ranks' saves: their data files leave nothing in the page cache (plain ones do: above)."""
    assert compose("+model=composite").checkpoint.bounded_cache is False
    _skip_unless_pages_can_be_dropped(tmp_path)
    train(
        tmp_path / "run", "+model=composite", "model.dim=64", "mesh=2", "train.steps=1", "checkpoint.bounded_cache=true"
    )
    files = sorted((tmp_path / "run" / "checkpoints").glob("step-*/__*.distcp"))
    assert len(files) == 2, files  # one per rank
    assert [_resident(f) for f in files] == [0, 0]


def _skip_unless_pages_can_be_dropped(tmp_path: Path) -> None:
    with open(tmp_path / "probe", "wb") as f:  # a file system that keeps pages (tmpfs) is not tested
        f.write(b"x" * (1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _resident(tmp_path / "probe"):
        pytest.skip("this file system keeps the pages cached")


def _resident(path: Path) -> int:
    out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_start_writeback_reaches_the_kernel(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 8192)
        f.flush()
        assert writer.start_writeback(f.fileno(), 0, 8192) is True
    assert writer.start_writeback(-1, 0, 8192) is False  # a bad descriptor: the kernel says no


def _direct_ok(path: Path) -> bool:
    fd = writer._open_direct(path / "probe")
    if fd is not None:
        os.close(fd)
    return fd is not None


@pytest.mark.parametrize("sizes", [[0], [1], [4095, 1], [8192], [8192 * 3 + 17], [5000, 70000, 3, 8192 * 2]])
def test_direct_writes_give_the_exact_bytes(tmp_path: Path, monkeypatch, sizes: list[int]) -> None:
    """Through O_DIRECT (8 KiB chunks here, 16 MiB in use): whole chunks as they fill, the last
    partial block padded and the file cut back to its length; the bytes and checksum are those
    written, whatever the sizes of the writes."""
    if not _direct_ok(tmp_path):
        pytest.skip("this file system has no O_DIRECT")
    monkeypatch.setattr(writer, "_DIRECT_CHUNK", 8192)
    want = os.urandom(sum(sizes))
    stream = writer._HashingStream(tmp_path / "f", "xxh3_128", direct=True)
    assert stream.direct
    at = 0
    for n in sizes:
        assert stream.write(memoryview(want)[at : at + n]) == n
        at += n
        assert stream.tell() == at
    stream.close()
    assert (tmp_path / "f").read_bytes() == want
    assert stream.hexdigest() == file_checksum(tmp_path / "f", "xxh3_128")


def test_no_direct_io_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    """A file system without O_DIRECT (tmpfs says EINVAL) gets the page-cache way."""
    import errno

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    stream = writer._HashingStream(tmp_path / "f", "xxh3_128", direct=True)
    assert not stream.direct
    stream.write(b"abc" * 5000)
    stream.close()
    assert (tmp_path / "f").read_bytes() == b"abc" * 5000


@pytest.mark.parametrize("sizes", [[100], [8192 + 100], [8192 * 2, 300]])
def test_direct_writes_refused_after_open_go_through_the_page_cache(tmp_path: Path, monkeypatch, sizes) -> None:
    """A file system may take O_DIRECT at open and refuse the writes (blocks larger than
    4 KiB): the file is then written through the page cache, with the same bytes."""
    import errno
    import fcntl

    if not _direct_ok(tmp_path):
        pytest.skip("this file system has no O_DIRECT")
    monkeypatch.setattr(writer, "_DIRECT_CHUNK", 8192)
    real_write = os.write

    def refuse_direct(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuse_direct)
    want = os.urandom(sum(sizes))
    stream = writer._HashingStream(tmp_path / "f", "xxh3_128", direct=True)
    assert stream.direct
    at = 0
    for n in sizes:
        stream.write(want[at : at + n])
        at += n
    stream.close()
    assert not stream.direct
    assert (tmp_path / "f").read_bytes() == want


def test_a_failed_write_is_not_finished_on_close(tmp_path: Path) -> None:
    """An error while DCP writes a file closes it as it is: no padding, fsync or second
    error hides the first (the checkpoint folder is never published)."""
    fs = writer.HashingFileSystem("xxh3_128")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with fs.create_stream(tmp_path / "f", "wb") as stream:
            stream.write(b"x" * 5000)
            raise RuntimeError("disk on fire")
    assert stream.closed and "f" not in fs.files
    assert torch.serialization.get_crc32_options() is True


def _record_publish(monkeypatch) -> list[tuple[str, ...]]:
    """Every fsync (of the path its descriptor names), rename, replace and symlink this process
    makes from now on, in order, from any thread: (op, path[, new path])."""
    events: list[tuple[str, ...]] = []
    real = {name: getattr(os, name) for name in ("fsync", "rename", "replace", "symlink")}

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real["fsync"](fd)

    def move(name: str):
        def call(src, dst, *args, **kwargs):
            real[name](src, dst, *args, **kwargs)
            events.append((name, os.path.abspath(src), os.path.abspath(dst)))

        return call

    def symlink(target, link, *args, **kwargs):
        real["symlink"](target, link, *args, **kwargs)
        events.append(("symlink", os.path.abspath(link)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", move("rename"))
    monkeypatch.setattr(os, "replace", move("replace"))
    monkeypatch.setattr(os, "symlink", symlink)
    return events


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fsync'd descriptor")
def test_a_save_publishes_nothing_before_its_bytes_are_durable(tmp_path: Path, mesh, monkeypatch) -> None:
    """The system calls of a real save (a second one, over a published first), in order: every
    file of the step folder fsync'd under the name it was written as, and renamed within the tmp
    folder after that (DCP's .metadata, the manifest); the tmp folder fsync'd; the tmp folder
    renamed to step-N; `latest` made as a new link and renamed over the old; checkpoints/
    fsync'd.  (A crash at any point leaves every visible name with its bytes on the disk.)"""
    from composerun.checkpoint.checkpointer import Checkpointer
    from composerun.models import build_model
    from composerun.train.optim import build_optimizer

    cfg = compose("+model=unit", "model.dim=8")
    model = build_model(cfg.model)
    optim = build_optimizer(model, cfg.optim)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    ck = Checkpointer(tmp_path, cfg.checkpoint, model, optim, {})
    ck.save(1)
    ck._pruner.wait()
    events = _record_publish(monkeypatch)
    ck.save(2)
    ck.close()
    monkeypatch.undo()
    root = str(tmp_path / "checkpoints")
    final = f"{root}/step-00000002"
    at = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == final]
    assert len(at) == 1, f"step-00000002 renamed into place {len(at)} times: {events}"
    moved = at[0]
    tmp = events[moved][1]

    def first(event: tuple[str, ...]) -> int:
        assert event in events, f"no {event} in {events}"
        return events.index(event)

    moves = [(i, e) for i, e in enumerate(events[:moved]) if e[0] in ("rename", "replace")]
    within = {e[2]: (i, e[1]) for i, e in moves if e[2].startswith(tmp + "/")}  # renamed within the tmp folder
    for name in sorted(os.listdir(final)):
        shown, written = within.get(f"{tmp}/{name}", (moved, f"{tmp}/{name}"))  # (renamed within tmp, or not)
        synced = [i for i, e in enumerate(events) if e == ("fsync", written)]
        assert synced and synced[0] < shown, f"{name}: made visible (event {shown}) before fsync of {written}: {events}"
    dir_synced = first(("fsync", tmp))
    assert max((i for i, _ in within.values()), default=-1) < dir_synced < moved, events
    [link] = [e for e in events if e[0] == "symlink"]
    assert link[1].startswith(f"{root}/latest.tmp-")
    made, pointed = first(link), first(("replace", link[1], f"{root}/latest"))
    assert moved < made, f"latest made (event {made}) before step-00000002 was renamed into place (event {moved})"
    assert made < pointed < first(("fsync", root)), events
    assert os.readlink(f"{root}/latest") == "step-00000002"


def test_bench_writes_script_runs(tmp_path: Path) -> None:
    """scripts/bench_writes.py (BENCHMARKS.md's figures for the three ways) still runs, and
    leaves nothing behind in --dir."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_writes.py"), "--mib", "64", "--repeats", "1", "--ways",
         "plain,bounded,direct", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for way in ("plain", "bounded", "direct"):
        assert re.search(rf"^{way} +s: [\d.]+  \(median [\d.]+\)$", out.stdout, re.M), out.stdout
    assert re.search(r"^bounded / plain: median [\d.]+", out.stdout, re.M), out.stdout
    assert list(tmp_path.iterdir()) == []
