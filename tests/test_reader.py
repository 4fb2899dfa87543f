"""composerun.checkpoint.reader.SafeReader on checkpoints written by plain `dcp.save` (one process, no group).

It reads whole tensors straight into their destinations and everything else DCP's way; both
must give back exactly what was saved, and the fast way must really be the one taken."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from composerun.checkpoint.reader import SafeReader, prefetch
from composerun.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(10, 8, generator=g)
    return {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "flag": torch.tensor([True, False, True]),
        "rows": big[2:5],  # a view into a larger storage
        "cols": big.t(),  # a non-contiguous view
        "scalar": torch.tensor(3.5),
        "hparams": {"lr": 0.25, "betas": (0.9, 0.95)},  # not a tensor: DCP stores it as bytes
    }


def _like(state: dict, make) -> dict:
    # DCP loads into the keys it finds: a placeholder for each non-tensor leaf
    return {k: make(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v) for k, v in state.items()}


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[dict, Path]:
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    return state, tmp_path / "ckpt"


def _load(path: Path, dest: dict) -> SafeReader:
    reader = SafeReader(str(path))
    dcp.load(dest, storage_reader=reader)
    return reader


def _assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_whole_tensors_are_read_into_their_destinations(saved) -> None:
    state, path = saved
    dest = _like(state, lambda t: torch.zeros(t.shape, dtype=t.dtype))
    reader = _load(path, dest)
    _assert_same(dest, state)
    nbytes = {k: v.numel() * v.element_size() for k, v in state.items() if isinstance(v, torch.Tensor)}
    # every tensor stored contiguous went the direct way, with no temporary and no copy; the
    # transposed view is stored with its strides (torch.save keeps them), so it is copied
    assert reader.bytes_copied == nbytes["cols"]
    assert reader.bytes_direct == sum(nbytes.values()) - nbytes["cols"]


def test_strided_destinations_and_slices_go_dcps_way(saved) -> None:
    state, path = saved
    # transposed destinations: same shape, not contiguous; DCP's path copies into them
    dest = _like(
        state,
        lambda t: torch.zeros(tuple(reversed(t.shape)), dtype=t.dtype).t() if t.dim() == 2 else torch.zeros_like(t),
    )
    reader = _load(path, dest)
    _assert_same(dest, state)
    strided = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() == 2]
    assert reader.bytes_copied == sum(t.numel() * t.element_size() for t in strided)
    assert reader.bytes_direct == sum(
        v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() != 2
    )


def test_a_truncated_file_is_refused_in_composeruns_own_line(saved) -> None:
    """A data file cut short: composerun's line names the file, by how much it is short, and
    what to do, before torch reads the cut item (torch's own error says only "failed finding
    central directory")."""
    state, path = saved
    data = next(path.glob("*.distcp"))
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    dest = _like(state, lambda t: torch.zeros(t.shape, dtype=t.dtype))
    with pytest.raises(dcp.CheckpointException) as info:  # DCP wraps a reader's error in its own
        _load(path, dest)
    ((error, _traceback),) = info.value.failures.values()
    assert isinstance(error, CheckpointError), error
    # the last item ends where the file did: that is how far the cut file falls short
    assert re.fullmatch(
        rf"{re.escape(str(data))}: ends {size - size // 2} bytes early \(\S+ is stored up to byte {size}\); "
        r"the checkpoint is truncated: use another checkpoint, or copy this one again",
        str(error),
    ), str(error)


def test_metadata_refuses_foreign_globals(tmp_path: Path) -> None:
    import pickle

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Path))  # a global outside the allow-list
    with pytest.raises(CheckpointError, match="not valid DCP metadata"):
        SafeReader(str(tmp_path)).read_metadata()


@pytest.mark.skipif(
    shutil.which("fincore") is None or not hasattr(os, "posix_fadvise"), reason="needs util-linux fincore"
)
def test_prefetch_fills_the_page_cache(tmp_path: Path) -> None:
    def resident(path: Path) -> int:
        out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES", str(path)], capture_output=True, text=True)
        return int(out.stdout.split()[0])

    path = tmp_path / "data"
    with open(path, "wb") as f:
        f.write(os.urandom(24 << 20))  # three prefetch chunks
        os.fsync(f.fileno())  # clean pages: DONTNEED drops them
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if resident(path) > (4 << 20):
        pytest.skip("this file system keeps the pages cached")
    prefetch([tmp_path / "missing", path]).join(timeout=60)  # a missing file is skipped
    deadline = time.monotonic() + 30  # the kernel reads asynchronously
    while resident(path) < path.stat().st_size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident(path) == path.stat().st_size


def test_conjugated_and_negated_tensors_keep_their_values(tmp_path: Path) -> None:
    """torch.save keeps a tensor's lazy conjugate/negative bit: those bytes are not the values."""
    c = torch.randn(3, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    state = {"conj": c.conj(), "neg": c.conj().imag, "plain": c}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    for dest in (
        {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()},
        {
            "conj": torch.zeros(3, 2, dtype=torch.complex64).conj(),
            "neg": torch.zeros(3, 2),
            "plain": torch.zeros_like(c),
        },
    ):
        _load(tmp_path / "ckpt", dest)
        for k, v in state.items():
            assert torch.equal(dest[k].resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg()), k


def test_a_direct_read_counts_as_an_in_place_write(saved) -> None:
    state, path = saved
    dest = _like(state, lambda t: torch.zeros(t.shape, dtype=t.dtype))
    before = dest["w"]._version
    assert _load(path, dest).bytes_direct > 0
    assert dest["w"]._version > before  # autograd would notice the weights changed under it


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_files_are_hashed_as_they_are_read(saved, algorithm: str) -> None:
    """Every byte, in file order, whichever way each item was read (the strided view's item
    is copied, the rest read direct), and whatever the plan skips: the digest is the file's."""
    from composerun.checkpoint.manifest import file_checksum

    state, path = saved
    names = {p.name: algorithm for p in path.glob("*.distcp")}
    subsets = {
        "all": list(state),
        "some": ["half", "cols", "scalar"],  # the items between and after them are read to be hashed
    }
    for keys in subsets.values():
        dest = _like({k: state[k] for k in keys}, lambda t: torch.zeros(t.shape, dtype=t.dtype))
        reader = SafeReader(str(path), checksums=names)
        dcp.load(dest, storage_reader=reader)
        _assert_same(dest, {k: state[k] for k in keys})
        assert reader.digests == {n: file_checksum(path / n, algorithm) for n in names}
    # a byte changed anywhere shows in the digest: in the zip records, in a tensor's data
    data = next(path.glob("*.distcp"))
    raw = data.read_bytes()
    original = file_checksum(data, algorithm)
    changed = 0
    for at in (40, len(raw) // 2, len(raw) - 30):
        data.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :])
        reader = SafeReader(str(path), checksums=names)
        try:
            dcp.load(_like(state, lambda t: torch.zeros(t.shape, dtype=t.dtype)), storage_reader=reader)
        except BaseException:  # noqa: BLE001 -- a broken zip record may fail the load instead
            continue
        assert reader.digests[data.name] == file_checksum(data, algorithm) != original
        changed += 1
    assert changed  # at least the byte in the data loaded


def test_files_not_named_or_not_read_get_no_digest(saved) -> None:
    state, path = saved
    reader = _load(path, _like(state, lambda t: torch.zeros(t.shape, dtype=t.dtype)))
    assert reader.digests == {}  # none asked for
    reader = SafeReader(str(path), checksums={"__9_0.distcp": "xxh3_128"})  # not a file of the plan
    dcp.load(_like(state, lambda t: torch.zeros(t.shape, dtype=t.dtype)), storage_reader=reader)
    assert reader.digests == {}
