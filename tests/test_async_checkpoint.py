"""Async checkpoints on real gloo ranks: training goes on while a save writes; the checkpoint
of step k holds step k's state even when staging is slow; a save every rank has written is
published at the next step boundary, or recovered at start-up after a crash (and a tmp
folder cut short or damaged is removed, never resumed); old checkpoints are pruned in the
background.

Slow storage and slow staging are contrived here by wrapping composerun's own file system
and stager.  The runs with more than one rank use start_method=fork, so that the ranks
inherit those wrappers; what a rank saw is written to a file of the test's.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_close_weights,
    compose,
    final_weights,
    latest_name,
    patience,
    read_metrics,
    set_latest,
    train,
)
from test_checkpoint import BASE, saved_optim

from composerun.checkpoint import checkpointer, folders, manifest, recovery, writer
from composerun.checkpoint.staging import OrderedStager
from composerun.errors import RunFailed
from composerun.train import trainer

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP loads with no group
]

ASYNC = "checkpoint.async=true"
# Forked ranks compute with one thread: GCC's OpenMP does not survive a fork of a process that
# ran a parallel region (this one, after an in-process run), and its first hangs.
ONE_THREAD = "launch.omp_threads=1"


def last_logged(run: Path) -> int:
    """The last step in rank 0's metrics.jsonl (0 if none yet)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):  # not there yet, or a line being written
        return 0


def wait_until_logged(run: Path, step: int, timeout: float = 30.0) -> int:
    """Wait until training has logged `step` (or `timeout` passed); the last step logged then."""
    deadline = time.monotonic() + timeout
    while last_logged(run) < step and time.monotonic() < deadline:
        time.sleep(0.005)
    return last_logged(run)


def note(path: Path, *values: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(values) + "\n")


def notes(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def record_publishes(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Each rank notes (rank, step published, the step training is at) as it publishes."""
    real = checkpointer.Checkpointer._publish

    def publish(self, *args) -> None:
        note(log, self.rank, args[-1], self.train.step)
        real(self, *args)

    monkeypatch.setattr(checkpointer.Checkpointer, "_publish", publish)


def test_training_goes_on_while_an_async_save_writes(tmp_path: Path, monkeypatch) -> None:
    """Rank 1's write of the step-20 save waits until training has logged step 23: it gets
    there (the steps go on while the save writes), and both ranks publish the save at the
    same step boundary, the first after every rank's write ended, well before the next save
    at step 40 (not when that save starts)."""
    run, seen, published = tmp_path / "run", tmp_path / "seen", tmp_path / "published"
    real = writer.HashingFileSystem.create_stream

    @contextmanager
    def slow(self, path, mode):
        if "w" in mode and "step-00000020.tmp-" in str(path) and Path(path).name.startswith("__1_"):
            note(seen, wait_until_logged(run, 23))  # rank 1's data file: the storage is slow
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(writer.HashingFileSystem, "create_stream", slow)
    record_publishes(monkeypatch, published)
    step = trainer.Trainer.step

    def slow_step(self, *args):  # 17 steps from 23 to 40 take 0.5 s at least: the rest of the write takes less
        time.sleep(0.03)
        return step(self, *args)

    monkeypatch.setattr(trainer.Trainer, "step", slow_step)
    train(run, *BASE, "mesh=2", "train.steps=40", "checkpoint.every=20", ASYNC, ONE_THREAD, start_method="fork")

    [[logged]] = notes(seen)
    assert logged >= 23, f"training stopped while the save wrote (last step logged: {logged})"
    at = {(rank, step): now for rank, step, now in notes(published)}
    assert set(at) == {(0, 20), (1, 20), (0, 40), (1, 40)}
    assert at[0, 20] == at[1, 20], f"the ranks published step 20 at different steps: {at}"
    assert 23 <= at[0, 20] < 40, f"step 20 published after step {at[0, 20]}: not as soon as it was written"
    assert latest_name(run / "checkpoints") == "step-00000040"
    manifest.check_integrity(run / "checkpoints" / "step-00000020")


def test_async_checkpoint_holds_its_step_when_staging_is_slow(tmp_path: Path, monkeypatch) -> None:
    """The copy of the state waits a while (0.6 s on an idle machine, longer on a busy one: the
    forward and backward it must outlast are slower there) before it starts, while the next
    step's forward and backward run: that step's optimizer step must wait for it, and each
    async checkpoint equals the sync run's of the same step, model and optimizer, bit for bit."""
    real = OrderedStager.copy
    delay = patience(0.3)

    def slow_copy(self, state_dict, ready):
        time.sleep(delay)
        return real(self, state_dict, ready)

    monkeypatch.setattr(OrderedStager, "copy", slow_copy)
    common = [*BASE, "mesh=2", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3"]
    train(tmp_path / "async", *common, ASYNC, ONE_THREAD, start_method="fork")
    train(tmp_path / "sync", *common, ONE_THREAD, start_method="fork")
    for step in (2, 4, 6):
        name = f"step-{step:08d}"
        for run in ("async", "sync"):  # final_weights reads `latest`: point it at each in turn
            set_latest(tmp_path / run / "checkpoints", name)
        got, want = final_weights(tmp_path / "async", *BASE), final_weights(tmp_path / "sync", *BASE)
        assert_close_weights(got, want, 0.0, f"async {name} model")
        got_optim = saved_optim(tmp_path / "async" / "checkpoints" / name)
        assert_close_weights(got_optim, saved_optim(tmp_path / "sync" / "checkpoints" / name), 0.0, f"{name} optim")
    waits = [r["checkpoint_wait_s"] for r in read_metrics(tmp_path / "async") if "checkpoint_wait_s" in r]
    assert len(waits) == 2 and min(waits) > 0.1, f"the steps after a save did not wait for its copy: {waits}"


def publish_boundaries(cfg, run_dir: str) -> int | None:
    """A rank of a real 2-rank async save whose part is done on rank 0 at once and on rank 1
    only at step boundary 3 (its done future held back): the boundary at which this rank
    published it (None: not in boundaries 0-5)."""
    from concurrent.futures import Future

    from composerun.models import build_model
    from composerun.parallel.apply import apply_policy
    from composerun.parallel.mesh import init_mesh, teardown
    from composerun.train.optim import build_optimizer

    torch.set_num_threads(1)  # (forked: see ONE_THREAD)
    mesh, _ = init_mesh(cfg.mesh)
    model = build_model(cfg.model)
    apply_policy(model, cfg.sharding, mesh)
    ck = checkpointer.Checkpointer(Path(run_dir), cfg.checkpoint, model, build_optimizer(model, cfg.optim), {})
    ck.save(1)
    written = ck._pending[0]
    written.result()  # every rank's part is written; rank 1 says so only at boundary 3
    held: Future = Future()
    if ck.rank == 1:
        ck._pending = (held, *ck._pending[1:])
    at = None
    for boundary in range(6):
        if boundary == 3:
            held.set_result(None)
        ck.poll()
        if at is None and ck._pending is None:
            at = boundary
    ck.close()
    teardown()
    return at


def test_every_rank_publishes_at_the_same_step_boundary(tmp_path: Path) -> None:
    """Rank 0's part of a save is done at boundaries 0-2, rank 1's only from 3: both publish at
    boundary 3 (rank 0 alone publishing earlier would mismatch the ranks' collectives)."""
    from composerun.config.schema import LaunchConfig, StartMethod
    from composerun.launch.agent import start_ranks

    cfg = compose(*BASE, "mesh=2", ASYNC)
    got = start_ranks(
        publish_boundaries, (cfg, str(tmp_path / "run")), 2, tmp_path, LaunchConfig(start_method=StartMethod.fork)
    )
    assert got == {0: 3, 1: 3}, f"the boundary at which each rank published: {got}"
    assert latest_name(tmp_path / "run" / "checkpoints") == "step-00000001"


CRASH_ARGS = (*BASE, "mesh=2", "train.steps=12", "checkpoint.every=4", ASYNC)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run (2 ranks, async saves at steps 4, 8, 12) whose ranks die the moment they would
    publish the step-8 save: its files all written, nothing published.  A copy of the run
    directory as the crash left it."""
    root = tmp_path_factory.mktemp("crashed")
    real = checkpointer.Checkpointer._publish

    def crash(self, *args) -> None:
        if args[-1] == 8:
            os._exit(3)  # as SIGKILL would: no clean-up of any kind
        real(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpointer.Checkpointer, "_publish", crash)
        with pytest.raises(RunFailed):
            train(root / "run", *CRASH_ARGS, ONE_THREAD, start_method="fork")
    ckpts = root / "run" / "checkpoints"
    assert latest_name(ckpts) == "step-00000004"
    [tmp] = [p.name for p in ckpts.glob("step-00000008.tmp-*")]
    assert sorted(p.name for p in (ckpts / tmp).glob("manifest.rank*")) == [
        "manifest.rank0.json",
        "manifest.rank1.json",
    ]
    shutil.copytree(root / "run", root / "as_left", symlinks=True)
    return root


def test_a_written_save_is_recovered_after_a_crash(crashed: Path, tmp_path: Path) -> None:
    """The same command after the crash resumes from step 8 (recovered: checksummed and
    published at start-up), not step 4, and ends with the weights of a run never stopped."""
    run = tmp_path / "run"
    shutil.copytree(crashed / "as_left", run, symlinks=True)
    summary = train(run, *CRASH_ARGS, ONE_THREAD, start_method="fork")
    assert Path(summary["resumed_from"]).name == "step-00000008"
    assert summary["start_step"] == 8
    root = run / "checkpoints"
    assert not list(root.glob("*.tmp-*")) and not list(root.glob("*/manifest.rank*"))
    manifest.check_integrity(root / "step-00000008")
    assert "recovered" in (run / "rank0.log").read_text()

    train(tmp_path / "straight", *CRASH_ARGS, ONE_THREAD, start_method="fork")
    got, want = final_weights(run, *BASE), final_weights(tmp_path / "straight", *BASE)
    assert_close_weights(got, want, 0.0, "the run recovered at step 8 vs the one never stopped")


def _drop_rank1_record(tmp: Path) -> None:
    (tmp / "manifest.rank1.json").unlink()


def _drop_every_record(tmp: Path) -> None:  # stopped (Ctrl-C) while every rank still wrote
    for share in tmp.glob("manifest.rank*.json"):
        share.unlink()


def _drop_rank1_record_and_file(tmp: Path) -> None:
    (tmp / "manifest.rank1.json").unlink()
    (tmp / "__1_0.distcp").unlink()  # what is left is consistent: only the count of ranks tells


def _flip_a_byte(tmp: Path) -> None:
    path = tmp / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only the checksum tells
    path.write_bytes(bytes(data))


def _truncate(tmp: Path) -> None:
    path = tmp / "__0_0.distcp"
    os.truncate(path, path.stat().st_size - 1)


def _drop_metadata(tmp: Path) -> None:
    (tmp / ".metadata").unlink()


def _stray_file(tmp: Path) -> None:
    (tmp / "__2_0.distcp").write_bytes(b"not recorded")


DAMAGE = {
    "a rank's record missing": _drop_rank1_record,
    "no rank's record": _drop_every_record,
    "a rank's record and file missing": _drop_rank1_record_and_file,
    "a data file changed": _flip_a_byte,
    "a data file truncated": _truncate,
    "no .metadata": _drop_metadata,
    "a file no rank recorded": _stray_file,
}


@pytest.mark.parametrize("damage", [None, *DAMAGE])
def test_only_a_complete_checksummed_tmp_folder_is_recovered(crashed: Path, tmp_path: Path, damage) -> None:
    """Start-up's recovery (in the launching process, before any rank) on the crashed run's
    checkpoints: as left, step 8 is published with its manifest; cut short or damaged, the tmp
    folder is removed and `latest` stays on step 4."""
    root = tmp_path / "checkpoints"
    shutil.copytree(crashed / "as_left" / "checkpoints", root, symlinks=True)
    [tmp] = root.glob("step-00000008.tmp-*")
    if damage is not None:
        DAMAGE[damage](tmp)
    got, notes = recovery.recover(root)
    assert not list(root.glob("*.tmp-*")), "a tmp folder was left"
    if damage is None:
        assert got == root / "step-00000008" and latest_name(root) == "step-00000008"
        manifest.check_integrity(got)
        assert not list(got.glob("manifest.rank*"))
    else:
        assert got is None and latest_name(root) == "step-00000004", damage
        assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004"]
        [said] = [n for n in notes if "step-00000008.tmp-" in n]
        assert said.startswith("removed what the stopped run left unfinished: "), said
    if damage in ("no rank's record", "a rank's record missing"):  # what was left, in plain words
        want = {"no rank's record": "no rank had", "a rank's record missing": "rank 0 of 2 had"}[damage]
        assert f"a save of step 8 cut short ({want} finished writing its files)" in said, said


def test_old_checkpoints_are_pruned_in_the_background(tmp_path: Path, monkeypatch) -> None:
    """checkpoint.keep's rotation after the step-2 save waits until training has logged
    step 3 before it removes anything: it gets there (nobody waits for the rotation), and
    the run still ends with only its newest checkpoint."""
    run, seen = tmp_path / "run", []
    real = folders.rotate

    def slow_rotate(root: Path, keep: int, newest: Path) -> list[Path]:
        if newest.name == "step-00000002":
            seen.append(wait_until_logged(run, 3, timeout=120))  # returns as soon as step 3 is logged
        return real(root, keep, newest)

    monkeypatch.setattr(folders, "rotate", slow_rotate)
    train(run, *BASE, "mesh=1", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=1")
    assert seen == [3], f"training waited for the rotation (last step logged: {seen})"
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000006"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_checkpoint_equals_sync_after_large_updates_on_gpu(tmp_path: Path) -> None:
    """On a GPU, the async save starts while the optimizer step's kernels may still run: the
    copy must wait for them.  A wide model, a learning rate that moves every weight by about
    twice its initial size each step, a save after every step: each async checkpoint is the
    sync run's, bit for bit."""
    common = [
        "+model=composite",
        "model.dim=2048",
        "optim.lr=0.05",
        "mesh=1",
        "train.deterministic=true",
        "train.steps=4",
        "checkpoint.every=1",
        "checkpoint.keep=4",
        "metrics.progress=false",
    ]
    train(tmp_path / "async", *common, ASYNC)
    train(tmp_path / "sync", *common)
    for step in range(1, 5):
        name = f"step-{step:08d}"
        for run in ("async", "sync"):
            set_latest(tmp_path / run / "checkpoints", name)
        got, want = final_weights(tmp_path / "async", *common), final_weights(tmp_path / "sync", *common)
        assert_close_weights(got, want, 0.0, f"async {name} on the GPU")
        ckpts = [tmp_path / run / "checkpoints" / name for run in ("async", "sync")]
        assert_close_weights(saved_optim(ckpts[0], *common), saved_optim(ckpts[1], *common), 0.0, f"{name} optim")
