"""The loader (composerun/data/loader.py): micro-batches from a DataLoader with worker
processes, in micro_batch_order's order, and a resume that consumes exactly the samples the
uninterrupted run would have, on another mesh, batch split or worker count.

- Loader tier (in this process): the same batches, in the same order, for any worker count
  and prefetch depth; a worker's failure reaches the step (a data source's ConfigError as its
  one line); workers are gone after close, ignore a job's SIGTERM, die with their rank, and
  are seeded from the loader's seed, never advancing the rank's global RNG.
- Distributed tier: runs whose data source records the sample ids it makes
  (tests/fixtures/recording.py), interrupted by a failure after a checkpoint, resumed with
  another mesh, split or worker count, against the uninterrupted run; resumed with another
  data.batch_size, against the sample indices that follow the checkpoint's.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import choose_start, compose, latest_name, patience, read_metrics
from fixtures.recording import rank_entry_with, read_records
from test_kill import group_members

from composerun.config import world_size_of
from composerun.data.loader import Loader, default_workers, micro_batch_order
from composerun.errors import PREEMPTED_EXIT_CODE, ConfigError
from composerun.launch import signals
from composerun.launch.agent import launch, start_ranks


class Ids:
    """Sample i is (i, i + 0.5); the pid of the process that made it comes along."""

    def __init__(self, fail_at: int | None = None, error: type[Exception] = ValueError, delay: float = 0.0) -> None:
        self.fail_at, self.error, self.delay = fail_at, error, delay

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail_at in indices:
            raise self.error(f"sample {self.fail_at} cannot be made")
        time.sleep(self.delay)
        x = torch.tensor(list(indices), dtype=torch.float64) + 0.5
        return x, torch.full((len(indices),), os.getpid())


class GlobalRandom:
    """A data source that draws from torch's global RNG: what a worker's seed gives it."""

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(len(indices)), torch.full((len(indices),), os.getpid())


def order(steps: int = 6) -> object:
    return micro_batch_order(first=16, steps=range(steps), batch=8, accum=2, micro=2, dp_rank=1)


def take(loader: Loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        return [loader.next() for _ in range(n)]
    finally:
        loader.close()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# --- the Loader in this process -------------------------------------------------------------


@pytest.mark.parametrize("workers,prefetch", [(0, 0), (0, 2), (2, 1), (2, 3), (3, 2)])
def test_batches_come_in_micro_batch_order(workers: int, prefetch: int) -> None:
    """Every micro-batch of replica 1's order (steps of 8 samples from sample 16, 2 micro-batches
    of 4, this replica's 2 of each), in order, whoever made it: with workers, each of them made some."""
    want = [list(r) for r in order()]
    assert want[:3] == [[18, 19], [22, 23], [26, 27]]
    got = take(Loader(Ids(), order(), torch.device("cpu"), prefetch, workers, seed=5), len(want))
    assert [(x - 0.5).long().tolist() for x, _ in got] == want
    makers = {int(pid[0]) for _, pid in got}
    assert makers == ({os.getpid()} if workers == 0 else makers - {os.getpid()}) and len(makers) == max(1, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failure_in_a_batch_reaches_the_step_that_takes_it(workers: int) -> None:
    """The batches before it arrive; then the data source's own error, raised by next(): its type
    and message (the one line the launcher shows), the worker's traceback in a note; a
    ConfigError as its own one line."""
    loader = Loader(Ids(fail_at=27), order(), torch.device("cpu"), 2, workers, seed=5)
    try:
        before = [loader.next(), loader.next()]
        assert [int(x[0]) for x, _ in before] == [18, 22]
        with pytest.raises(ValueError) as e:
            loader.next()
    finally:
        loader.close()  # (the error's traceback, still held here, runs through the DataLoader's iterator)
    assert not wait_gone({int(pid[0]) for _, pid in before} - {os.getpid()}, patience(2)), "workers left after close()"
    assert str(e.value) == "sample 27 cannot be made"
    notes = "".join(getattr(e.value, "__notes__", []))
    assert ("made in DataLoader worker" in notes and "in batch" in notes) == (workers > 0)
    loader = Loader(Ids(fail_at=18, error=ConfigError), order(), torch.device("cpu"), 2, workers, seed=5)
    with pytest.raises(ConfigError) as e:
        take(loader, 1)
    assert str(e.value) == "sample 18 cannot be made"


def test_workers_are_gone_after_close_and_ignore_a_jobs_sigterm() -> None:
    """A SIGTERM to the job (its process group) reaches the workers too: they go on (the rank
    checkpoints, then shuts them down); close() midway, with batches still being made, ends
    them in a few seconds."""
    loader = Loader(Ids(delay=0.2), order(50), torch.device("cpu"), 2, 2, seed=5)
    first = [loader.next() for _ in range(2)]
    pids = {int(pid[0]) for _, pid in first}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    later = [loader.next() for _ in range(4)]
    assert {int(pid[0]) for _, pid in later} == pids, "a worker died of SIGTERM"
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < patience(8)  # a few seconds (more on a busy machine), not a hang
    assert not wait_gone(pids, patience(5)), "workers left running after close()"


def test_a_dead_worker_fails_the_step_and_close_ends_the_others() -> None:
    """A worker killed (the OOM killer, say): the DataLoader's error reaches the step, raised
    inside its iterator (so the error's traceback holds the iterator); close() still ends the
    other worker."""
    loader = Loader(Ids(delay=0.1), order(50), torch.device("cpu"), 2, 2, seed=5)
    try:
        pids = [int(loader.next()[1][0]) for _ in range(2)]
        os.kill(pids[0], signal.SIGKILL)
        # torch names the worker from its SIGCHLD handler ("is killed by signal") or, when its
        # queue's timeout comes first (seen on a loaded machine), from its check of the workers
        dead = rf"DataLoader worker \(pid(\(s\))? {pids[0]}\) (is killed by signal|exited unexpectedly)"
        with pytest.raises(RuntimeError, match=dead):
            for _ in range(50):
                loader.next()
    finally:
        loader.close()
    assert not wait_gone({pids[1]}, patience(2)), "the other worker was left running"


def _rank(conn) -> None:
    loader = Loader(Ids(), order(50), torch.device("cpu"), 2, 2, seed=5)
    conn.send(sorted({int(loader.next()[1][0]) for _ in range(4)}))
    time.sleep(60)


def test_workers_die_with_their_rank() -> None:
    """A rank SIGKILLed (no close, no atexit) leaves no worker: each dies with it (PR_SET_PDEATHSIG),
    well before the DataLoader's own watchdog (5 s) would notice."""
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    rank = ctx.Process(target=_rank, args=(there,))
    rank.start()
    try:
        assert here.poll(patience(30)), "the rank made no batch"
        workers = set(here.recv())
        assert len(workers) == 2 and all(alive(p) for p in workers)
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        rank.join()
    assert not wait_gone(workers, 2.5), "workers outlived their SIGKILLed rank"


def test_workers_are_seeded_from_the_loaders_seed_not_the_ranks_rng() -> None:
    """A data source drawing from torch's global RNG gets in each worker a generator seeded from
    the loader's seed (repeatable for one worker count, another seed another stream); making a
    loader, with or without workers, leaves the rank's own global RNG where it was."""

    def draws(seed: int, workers: int) -> list[float]:
        return [float(x[0]) for x, _ in take(Loader(GlobalRandom(), order(), torch.device("cpu"), 2, workers, seed), 8)]

    torch.manual_seed(0)
    state = torch.get_rng_state()
    first, again, other = draws(7, 2), draws(7, 2), draws(8, 2)
    assert first == again and first != other
    take(Loader(Ids(), order(), torch.device("cpu"), 2, 0, seed=7), 8)  # (GlobalRandom would draw in the rank)
    assert torch.equal(torch.get_rng_state(), state), "the loader drew from the rank's global RNG"


def test_workers_default_and_bad_values() -> None:
    """null: 2 on a CUDA device, 0 on the CPU or with data.prefetch=0; workers with prefetch=0,
    or a negative count, is refused in one line."""
    assert default_workers(None, 2, torch.device("cuda")) == 2
    assert default_workers(None, 0, torch.device("cuda")) == 0
    assert default_workers(None, 2, torch.device("cpu")) == 0
    assert default_workers(3, 2, torch.device("cpu")) == 3
    with pytest.raises(ConfigError, match=r"^data.workers=2 with data.prefetch=0: .*data.workers=0"):
        compose("+model=unit", "data.workers=2", "data.prefetch=0")
    with pytest.raises(ConfigError, match=r"^data.workers=-1: must be 0"):
        compose("+model=unit", "data.workers=-1")
    compose("+model=unit", "data.workers=0", "data.prefetch=0")


# --- a resume consumes the uninterrupted run's samples -------------------------------------------

STEPS, B = 6, 8
RECORDED = (
    "+model=unit", "model.dim=8", f"train.steps={STEPS}", f"data.batch_size={B}", "checkpoint.every=2",
    "data._target_=fixtures.recording.RecordingData",
)  # fmt: skip


def recorded_run(
    run_dir: Path, record: Path, *overrides: str, fail_at: int | None = None, base: tuple[str, ...] = RECORDED
) -> None:
    """A run of `base` whose data source records the ids it makes into `record`/ids.txt: conftest's
    `train` (the launcher's start), with the variables the source reads set in each rank."""
    record.mkdir(parents=True)
    env = {"COMPOSERUN_RECORD_DIR": str(record)}
    if fail_at is not None:
        env["COMPOSERUN_RECORD_FAIL_AT"] = str(fail_at)
    cfg = compose(*base, *overrides, "launch.start_method=forkserver", "metrics.progress=false")
    run_dir.mkdir(parents=True, exist_ok=True)
    start, world = choose_start(cfg, run_dir), world_size_of(cfg.mesh.shape)
    with pytest.MonkeyPatch.context() as patch:
        for k, v in env.items():  # (one rank trains in this process)
            patch.setenv(k, v)
        if world == 1:
            launch(cfg, run_dir, world, start)
        else:  # ranks from the fork server, as launch() starts them, each setting `env` first
            launcher = {"pid": os.getpid(), "ignore_hup": signals.HUP_IGNORED, "lock": None}
            start_ranks(rank_entry_with, (env, cfg, str(run_dir), start, "INFO", launcher), world, run_dir, cfg.launch)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted run (mesh=2, 2 workers each), and the same run failing in step 4 (its
    data source fails on step 4's first sample) after its checkpoint of step 2."""
    root = tmp_path_factory.mktemp("loader")
    recorded_run(root / "reference", root / "reference.ids", "mesh=2", "data.workers=2")
    with pytest.raises(Exception, match="planted failure at sample 24"):
        recorded_run(root / "failed", root / "failed.ids", "mesh=2", "data.workers=2", fail_at=3 * B)
    return {"root": root, "reference": root / "reference", "failed": root / "failed"}


def test_a_failing_run_leaves_no_worker(interrupted: dict[str, Path]) -> None:
    """The failed run's workers made its batches (pids other than its ranks'), and none is left."""
    made = read_records(interrupted["root"] / "failed.ids")
    assert sorted(i for _, ids in made for i in ids)[: 3 * B] == list(range(3 * B)), "steps 1-3 were made"
    pids = {pid for pid, _ in made}
    assert len(pids) == 4, f"2 ranks x 2 workers made the batches, not {pids}"
    assert not wait_gone(pids, patience(10)), "a worker outlived its failed run"


RESUMES = {
    "mesh": ("mesh=1", "data.workers=2"),  # 2 ranks -> 1
    "split": ("mesh=2", "train.grad_accum=2", "data.workers=2"),  # 2 x 4 samples a step -> 2 x 2 x 2
    "workers": ("mesh=2", "data.workers=0"),  # 2 workers a rank -> none
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_resume_consumes_the_uninterrupted_runs_samples(name: str, interrupted: dict[str, Path]) -> None:
    """Resumed from step 2 with another mesh, split or worker count, the run makes exactly the
    samples of steps 3-6 (each once, no micro-batch across two steps) and trains each step on
    the uninterrupted run's samples of that step: its losses are the reference's."""
    root = interrupted["root"]
    reference = read_records(root / "reference.ids")
    assert sorted(i for _, ids in reference for i in ids) == list(range(STEPS * B))
    run_dir = root / f"resumed_{name}"
    shutil.copytree(interrupted["failed"], run_dir, symlinks=True)
    recorded_run(run_dir, root / f"{name}.ids", *RESUMES[name])
    made = read_records(root / f"{name}.ids")
    assert sorted(i for _, ids in made for i in ids) == list(range(2 * B, STEPS * B))
    assert all(len({i // B for i in ids}) == 1 for _, ids in made), "a micro-batch across two steps"
    want, got = losses(interrupted["reference"]), losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and got[1] == want[1]  # the failed run's rows, then the resumed
    for step in (3, 4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"


def test_a_resume_with_another_batch_size_takes_up_exactly_the_next_samples(interrupted: dict[str, Path]) -> None:
    """Resumed from step 2 (16 samples consumed, 8 a step) with data.batch_size=12 on mesh 2
    (6 samples a rank), steps 3-6 train on samples 16..63: step s on the 12 after the
    16 + 12 * (s - 3) consumed before it, each made once; the change is said on rank 0."""
    root, batch = interrupted["root"], 12
    run_dir = root / "resumed_batch_size"
    shutil.copytree(interrupted["failed"], run_dir, symlinks=True)
    recorded_run(run_dir, root / "batch_size.ids", "mesh=2", f"data.batch_size={batch}", "data.workers=0")
    made = read_records(root / "batch_size.ids")
    first = 2 * B
    assert sorted(i for _, ids in made for i in ids) == list(range(first, first + (STEPS - 2) * batch))
    for step in range(4):  # each rank's micro-batch of step 3 + step: its half of the step's samples
        want = {tuple(range(first + step * batch + r * 6, first + step * batch + r * 6 + 6)) for r in range(2)}
        assert {tuple(ids) for _, ids in made if (ids[0] - first) // batch == step} == want, f"step {3 + step}"
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert f"resume: data.batch_size {B} -> {batch}" in (run_dir / "rank0.log").read_text()


# --- end-to-end: SIGKILL mid-run on mesh 2x2, resume on mesh 2; a job's SIGTERM ---------------------

PROG = str(Path(sys.executable).with_name("composerun"))
CLI_ONLY = ("metrics.progress=false", "hydra.run.dir=run")  # (train() sets the first, takes the run dir)
LLAMA_STEPS, LLAMA_B = 12, 8
LLAMA = (
    "+model=llama3_debug", "data=tokens", "sharding=fsdp_blocks", f"train.steps={LLAMA_STEPS}",
    f"data.batch_size={LLAMA_B}", "data.seq_len=16", "checkpoint.every=2",
    "data._target_=fixtures.recording.RecordingTokens",
)  # fmt: skip


def start(cwd: Path, record: Path, *args: str) -> subprocess.Popen:
    """`composerun ARGS` in a session of its own (its process group killed as one), recording ids."""
    cwd.mkdir(parents=True, exist_ok=True)
    record.mkdir(parents=True)
    env = {
        **os.environ, "PYTHONWARNINGS": "ignore", "COMPOSERUN_RECORD_DIR": str(record),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    with open(cwd / f"{record.name}.out", "w") as out:
        return subprocess.Popen(
            [PROG, *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"composerun (pid {proc.pid}) did not end in {timeout} s") from None


def wait_until(proc: subprocess.Popen, cond, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the moment came"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.02)


def trained_ids(record: Path, launcher: int) -> list[int]:
    """The ids the ranks made (the launcher's own check of one batch left out)."""
    return sorted(i for pid, ids in read_records(record) if pid != launcher for i in ids)


@pytest.mark.e2e
def test_llama_killed_on_2x2_resumed_on_2_trains_the_uninterrupted_runs_samples(tmp_path: Path) -> None:
    """The issue's acceptance: `+model=llama3_debug data=tokens mesh=2x2 sharding=fsdp_blocks` (a
    worker a rank, forked from forkserver-started ranks), its process group SIGKILLed mid-run once
    a checkpoint is out, resumed on mesh=2 with no workers: the resumed run makes exactly the
    samples of the steps after its checkpoint, and its losses are the uninterrupted run's.  The
    command is the killed run alone; the reference and the resumed run are its rank code on ranks
    from this process's fork server (the same launch, without a launcher process to import torch again)."""
    recorded_run(tmp_path / "reference" / "run", tmp_path / "reference.ids", "mesh=2x2", "data.workers=1", base=LLAMA)
    assert trained_ids(tmp_path / "reference.ids", os.getpid()) == list(range(LLAMA_STEPS * LLAMA_B))
    want = losses(tmp_path / "reference" / "run")
    assert want[LLAMA_STEPS] < want[1], "the loss falls"

    cwd = tmp_path / "killed"
    killed = start(cwd, tmp_path / "killed.ids", *LLAMA, "mesh=2x2", "data.workers=1", *CLI_ONLY)
    root = cwd / "run" / "checkpoints"
    wait_until(killed, lambda: (root / "latest").is_symlink() and latest_name(root) >= "step-00000004")
    os.killpg(killed.pid, signal.SIGKILL)
    finish(killed)
    assert not wait_gone(set(group_members(killed.pid)), patience(10)), "a process of the killed run survived"
    at = int(latest_name(root).split("-")[1])
    assert 4 <= at < LLAMA_STEPS, f"killed after the run ended (checkpoint of step {at})"
    assert trained_ids(tmp_path / "killed.ids", killed.pid)[: at * LLAMA_B] == list(range(at * LLAMA_B))

    recorded_run(cwd / "run", tmp_path / "resumed.ids", "mesh=2", "data.workers=0", base=LLAMA)
    assert trained_ids(tmp_path / "resumed.ids", os.getpid()) == list(range(at * LLAMA_B, LLAMA_STEPS * LLAMA_B))
    got = losses(cwd / "run")
    for step in range(at + 1, LLAMA_STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"


@pytest.mark.e2e
def test_a_jobs_sigterm_reaches_the_workers_and_the_run_still_checkpoints(tmp_path: Path) -> None:
    """SIGTERM to the whole process group (as a scheduler signals every process of a job):
    the workers go on making batches until the ranks agree on the stop and checkpoint; the run
    exits as preempted, leaving no process, and the same run (its rank code on ranks from
    this process's fork server) completes it."""
    steps, args = 60, ("checkpoint.every=0", "mesh=2", "data.workers=2")
    run = start(tmp_path, tmp_path / "first.ids", *RECORDED, f"train.steps={steps}", *args, *CLI_ONLY)
    wait_until(run, lambda: len(read_records(tmp_path / "first.ids")) >= 2 * 2 * 6)  # both ranks past step 5
    os.killpg(run.pid, signal.SIGTERM)
    out = tmp_path / "first.ids.out"
    assert finish(run) == PREEMPTED_EXIT_CODE, out.read_text()[-3000:]
    assert "preempted (SIGTERM)" in out.read_text()
    assert not wait_gone(set(group_members(run.pid)), patience(10)), "a process of the preempted run is left"
    saved = latest_name(tmp_path / "run" / "checkpoints")
    assert saved, f"preempted with no checkpoint:\n{(tmp_path / 'run' / 'rank0.log').read_text()[-2000:]}"
    stopped = int(saved.split("-")[1])
    assert stopped < steps, f"the run ended ({saved}) before the SIGTERM stopped it"
    recorded_run(tmp_path / "run", tmp_path / "second.ids", *args, f"train.steps={steps}")
    assert trained_ids(tmp_path / "second.ids", os.getpid()) == list(range(stopped * B, steps * B))
