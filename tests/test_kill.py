"""Kill test (end-to-end): SIGKILL a checkpointing run at random moments, start it again
in the same run directory, and it completes with the weights of a run never interrupted.

Every `composerun` here is started in a session of its own, so that one
`os.killpg(pgid, SIGKILL)` takes down the parent, the elastic agent and every rank at
once, as a machine losing power would.  The start killed in start-up runs as typed; the
others fork from the session's process that has imported composerun (as `cli` runs it).  The kill moments come from a seeded RNG
(`COMPOSERUN_KILL_SEED` picks another set): reproducible, yet spread over start-up,
training steps and checkpoint saves.  A save is caught in the act by watching the
checkpoint folder for a `step-N.tmp-<id>` folder, which lives only while the ranks write.

One run directory is killed four times, each time the same command is started again, beside
the uninterrupted reference (the same run's rank code on ranks from this process's fork server:
what is compared is the ranks' arithmetic): killed in start-up; a random fraction of a step after
a random step was logged; while saving a random periodic checkpoint; while saving the last
checkpoint or just after it was published (each aim past what the earlier runs logged).
Every start after a kill resumes from the newest complete checkpoint that kill left.  The run
directory then completes (exit 0) with the same command; its final weights are bitwise those
of the uninterrupted reference, `latest` names the last step, no tmp folder is left, and
metrics.jsonl holds one row per step (the steps trained again keep the completing run's), and
every row (those the killed runs left too) is bitwise the reference's for its step.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import _forks as forks
from conftest import assert_close_weights, final_weights, patience, read_metrics, run_two_at_a_time, train

pytestmark = pytest.mark.e2e

STEPS, EVERY = 24, 2
ARGS = ("+model=composite", "model.dim=16", "mesh=2", f"train.steps={STEPS}", f"checkpoint.every={EVERY}")
# seed 6: a kill 4.5 s into start-up, one 105 ms after step 2 was logged, one 1 ms into the save of
# step 14 and one 494 ms after the last save began (pytest -s prints what each kill left)
SEED = int(os.environ.get("COMPOSERUN_KILL_SEED", "6"))
RUN_TIMEOUT = patience(150)  # seconds for one run to complete (a hang guard)
WAIT_TIMEOUT = 120  # seconds to wait for a kill moment
TRIALS = ("four_kills",)
PROG = str(Path(sys.executable).with_name("composerun"))


# --- processes -------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


class Runs:
    """Every `composerun` started in its own session; `kill_all` ends what is left."""

    def __init__(self) -> None:
        self.procs: list[Any] = []  # Popen, or forked runs with its pid, poll and wait

    def start(self, cwd: Path, tag: str, typed: bool = False) -> subprocess.Popen | Any:
        """`composerun ARGS` in CWD: as typed (`typed`, the start-up kill's aim includes imports) or forked."""
        cwd.mkdir(parents=True, exist_ok=True)
        env, out, err = {**os.environ, "PYTHONWARNINGS": "ignore"}, cwd / f"{tag}.out", cwd / f"{tag}.err"
        if not typed:
            proc = forks().start("composerun", [*ARGS, "hydra.run.dir=run"], cwd, env, out, err)
        else:
            with open(out, "w") as o, open(err, "w") as e:
                cmd, std = [PROG, *ARGS, "hydra.run.dir=run"], {"stdout": o, "stderr": e, "stdin": subprocess.DEVNULL}
                proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, **std)
        self.procs.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL the run's whole process group; return once none of it is alive."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=patience(30))
        deadline = time.monotonic() + patience(10)
        while (alive := group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"processes {alive} of run {proc.pid} survived SIGKILL"

    def complete(self, proc: subprocess.Popen, cwd: Path, tag: str) -> None:
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            raise AssertionError(f"{cwd}: {tag} did not finish in {RUN_TIMEOUT} s") from None
        assert rc == 0, f"{cwd}: {tag} exited {rc}:\n{output(cwd, tag)[-3000:]}"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None or group_members(proc.pid):
                try:
                    self.kill(proc)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass


def output(cwd: Path, tag: str) -> str:  # what the run `tag` printed: its stdout, then its stderr
    return (cwd / f"{tag}.out").read_text() + (cwd / f"{tag}.err").read_text()


# --- what a run directory shows ----------------------------------------------------------------


def ckpt_root(cwd: Path) -> Path:
    return cwd / "run" / "checkpoints"


def tmp_entries(cwd: Path) -> list[str]:
    root = ckpt_root(cwd)
    return sorted(p.name for p in root.glob("*.tmp-*")) if root.is_dir() else []


def latest_name(cwd: Path) -> str | None:
    from composerun.checkpoint.folders import read_latest

    return read_latest(ckpt_root(cwd))


def logged_steps(cwd: Path) -> int:
    """The last step in metrics.jsonl (0 if none)."""
    path = cwd / "run" / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


def wait_for(proc: subprocess.Popen, what: str, cond: Callable[[], Any], poll: float) -> Any:
    """Poll `cond` until it returns something true; fails if the run ends first."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"no {what} within {WAIT_TIMEOUT} s")


def save_in_progress(cwd: Path, min_step: int) -> Callable[[], str | None]:
    """A `step-N.tmp-<id>` folder with N >= min_step: the ranks are writing that checkpoint."""
    root = ckpt_root(cwd)

    def cond() -> str | None:
        try:
            names = [e.name for e in os.scandir(root)]
        except FileNotFoundError:
            return None
        hits = [n for n in names if n.startswith("step-") and ".tmp-" in n and int(n[5:13]) >= min_step]
        return min(hits) if hits else None

    return cond


def newest_complete(cwd: Path) -> str | None:
    """The checkpoint a restart must resume from: a save every rank had written and recorded
    but not yet published (start-up publishes it), else the one `latest` names, else the
    newest published step-N (both with a manifest)."""
    from composerun.checkpoint.recovery import candidate

    root, name = ckpt_root(cwd), latest_name(cwd)
    if root.is_dir() and (found := candidate(root)):
        return Path(found[0]).name.split(".tmp-")[0]
    if name and (root / name / "manifest.json").is_file():
        return name
    done = sorted(p.name for p in root.glob("step-*") if ".tmp-" not in p.name and (p / "manifest.json").is_file())
    return done[-1] if done else None


def after_kill(cwd: Path, aim: str, t0: float, alive: bool) -> dict[str, Any]:
    """What a kill hit, read from the run directory it left."""
    left = tmp_entries(cwd)
    return {
        "aim": aim,
        "alive": alive,  # False: the run had exited by itself already
        "at_s": round(time.monotonic() - t0, 2),
        "resumable": newest_complete(cwd),
        "last_logged_step": logged_steps(cwd),
        "latest": latest_name(cwd),
        "tmp_left": left,
        "mid_save": any(n.startswith("step-") for n in left),
        # killed after rank 0 wrote the summary of the finished run (in its teardown)
        "finished": _summary_status(cwd) == "ok",
    }


def _summary_status(cwd: Path) -> str | None:
    try:
        return json.loads((cwd / "run" / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


# --- the trials ------------------------------------------------------------------------------


def kill_run(runs: Runs, cwd: Path, tag: str, rng: random.Random, aim: str) -> dict[str, Any]:
    """Start the command in `cwd`, kill its process group at a moment picked by `aim`."""
    t0 = time.monotonic()
    proc = runs.start(cwd, tag, typed=aim == "startup")
    alive = False
    try:
        before = logged_steps(cwd)  # the rows earlier runs left (this one resumes at or below them)
        if aim == "startup":
            delay = rng.uniform(1.0, 5.0)  # start-up alone takes ~8-10 s
            time.sleep(delay)
            aim = f"start-up, {delay:.2f} s in"
        elif aim == "save":
            # a periodic save before the last step, after those of the earlier runs
            step = rng.randrange(before - before % EVERY + EVERY, STEPS, EVERY)
            seen = wait_for(proc, f"a save of step >= {step}", save_in_progress(cwd, step), poll=0.002)
            delay = rng.uniform(0.0, 0.02)  # a save takes ~0.1 s
            time.sleep(delay)
            aim = f"save of step >= {step} ({seen} seen, +{delay * 1e3:.0f} ms)"
        elif aim == "training":
            step = rng.randrange(before + 1, (before + STEPS) // 2)  # a step this run logs, well before the end
            wait_for(proc, f"step {step} logged", lambda: logged_steps(cwd) >= step, poll=0.005)
            delay = rng.uniform(0.0, 0.15)  # a step is ~0.05 s, a save ~0.1 s
            time.sleep(delay)
            aim = f"training, {delay * 1e3:.0f} ms after step {step} was logged"
        elif aim == "final_save":
            seen = wait_for(proc, "the last save", save_in_progress(cwd, STEPS), poll=0.002)
            delay = rng.uniform(0.0, 0.5)  # the save, its publishing, the exit
            time.sleep(delay)
            aim = f"last save ({seen} seen, +{delay * 1e3:.0f} ms)"
        else:
            raise ValueError(aim)
        alive = proc.poll() is None
    finally:
        runs.kill(proc)
    return after_kill(cwd, aim, t0, alive)


PLANS = {"four_kills": ("startup", "training", "save", "final_save")}


def run_trial(runs: Runs, cwd: Path, name: str) -> dict[str, Any]:
    rng = random.Random(f"{SEED}-{name}")
    t0 = time.monotonic()
    kills = [kill_run(runs, cwd, f"kill{i}", rng, aim) for i, aim in enumerate(PLANS[name], 1)]
    proc = runs.start(cwd, "final")
    runs.complete(proc, cwd, "final")
    log = (cwd / "run" / "rank0.log").read_text()
    summary = json.loads((cwd / "run" / "summary.json").read_text())
    return {
        "kills": kills,
        # every start's "resumed from ... at step S" line, the killed ones' too
        "resumes": [
            Path(line.split("] resumed from ")[1].split()[0]).name
            for line in log.splitlines()
            if "] resumed from " in line
        ],
        "resumed_from": summary["resumed_from"],
        "start_step": summary["start_step"],
        "wall_s": round(time.monotonic() - t0, 1),
        "final_out": output(cwd, "final"),
    }


def run_reference(cwd: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    train(cwd / "run", *ARGS)
    return {"wall_s": round(time.monotonic() - t0, 1)}


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the trial, and the reference meanwhile (in this thread: the elastic agent that starts
    its ranks sets signal handlers); each one's record or error."""
    root = tmp_path_factory.mktemp("kill")
    runs = Runs()
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda name=name: run_trial(runs, root / name, name)) for name in TRIALS
    }
    out: dict[str, Any] = {"root": root}
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            trial = pool.submit(run_two_at_a_time, jobs)  # (one job: its record or its error)
            try:
                out["reference"] = run_reference(root / "reference")
            except Exception as e:  # noqa: BLE001 - for the tests that need it to report
                out["reference"] = e
            out.update(trial.result())
    finally:
        runs.kill_all()
    out["total_s"] = round(time.monotonic() - t0, 1)
    out["pgids"] = [proc.pid for proc in runs.procs]
    print(f"\nkill trials (seed {SEED}): {out['total_s']} s in all; reference: {out['reference']}")
    for name in TRIALS:
        r = out[name]
        if isinstance(r, Exception):
            print(f"{name}: FAILED: {r!r}"[:500])
            continue
        for k in r["kills"]:
            print(
                f"{name}: killed at {k['at_s']} s ({k['aim']}{'' if k['alive'] else ', ALREADY EXITED'}): "
                f"last logged step {k['last_logged_step']}, latest {k['latest']}, left {k['tmp_left']}"
                f"{' MID-SAVE' if k['mid_save'] else ''}"
            )
        how = f"resumed at step {r['start_step']}" if r["resumed_from"] else "started over"
        print(f"{name}: completed ({how}; resumes seen: {r['resumes']}), {r['wall_s']} s")
    return out


@pytest.fixture(scope="module")
def reference(trials: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if isinstance(trials["reference"], Exception):
        raise trials["reference"]
    ref = trials["root"] / "reference" / "run"
    return final_weights(ref, *ARGS), read_metrics(ref)


@pytest.mark.parametrize("name", TRIALS)
def test_killed_run_completes_bitwise_equal(name: str, trials: dict[str, Any], reference) -> None:
    record = trials[name]
    if isinstance(record, Exception):
        raise record
    run = trials["root"] / name / "run"
    want_weights, want_rows = reference

    assert latest_name(run.parent) == f"step-{STEPS:08d}"
    left = [n for n in tmp_entries(run.parent) if (ckpt_root(run.parent) / n).is_dir()]
    assert not left, f"tmp folders left after the completing run: {left}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    if record["kills"][-1]["finished"]:  # killed in its teardown: the same command reports it, trains nothing
        assert "already trained" in record["final_out"] and "(nothing to do)" in record["final_out"], record
    else:  # the completing run resumed from the newest complete checkpoint the last kill left
        resumed = Path(summary["resumed_from"]).name if summary["resumed_from"] else None
        assert resumed == record["kills"][-1]["resumable"], record
    # and so did the start after each earlier kill (each got past its resume before it was killed)
    earlier = [k["resumable"] for k in record["kills"][:-1] if k["resumable"]]
    assert record["resumes"][: len(earlier)] == earlier, record

    got = final_weights(run, *ARGS)
    assert_close_weights(got, want_weights, atol=0.0, what=f"{name} vs the uninterrupted run")
    for key, want in want_weights.items():
        assert got[key].dtype == want.dtype and got[key].numpy().tobytes() == want.numpy().tobytes(), key

    rows = read_metrics(run)
    assert rows[-1]["step"] == STEPS
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"{name}: a step logged twice: {steps}"
    # the completing run logged start_step+1 .. STEPS, in order, at the end of the file
    tail = rows[len(rows) - (STEPS - record["start_step"]) :] if STEPS > record["start_step"] else []
    assert [r["step"] for r in tail] == list(range(record["start_step"] + 1, STEPS + 1))
    # every row, the killed runs' too, is the reference's row for that step, bit for bit
    by_step = {r["step"]: r for r in want_rows}
    for r in rows:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == by_step[r["step"]][key], f"{name}: step {r['step']} {key} differs from the reference"


def test_trials_hit_a_save_and_resumed(trials: dict[str, Any]) -> None:
    """The trials did what they are for: at least one kill landed inside a save (its tmp
    folder was left behind) and at least one restart resumed from a checkpoint."""
    done = {n: r for n, r in trials.items() if n in TRIALS and not isinstance(r, Exception)}
    assert done, "no trial completed"
    resumed = {n: r["resumed_from"] for n, r in done.items()}
    mid_save = {n: [k["mid_save"] for k in r["kills"]] for n, r in done.items()}
    assert any(resumed.values()), f"no trial resumed: {resumed}"
    assert any(any(v) for v in mid_save.values()), f"no kill landed inside a save: {mid_save}"
    started_over = [n for n, r in done.items() if r["resumed_from"] is None]
    print(f"\nresumed: { {n: v for n, v in resumed.items() if v} }; started over: {started_over}")


def test_no_process_left(trials: dict[str, Any]) -> None:
    """Nothing any trial started is still running: every run's process group is empty."""
    alive = {pgid: group_members(pgid) for pgid in trials["pgids"]}
    assert not any(alive.values()), f"stray processes: { {g: m for g, m in alive.items() if m} }"
