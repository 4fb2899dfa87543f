"""Preemption (end-to-end): SIGTERM or SIGUSR1 to the `composerun` a user started makes
every rank checkpoint the step it is in and exit with PREEMPTED_EXIT_CODE, with one line on
stderr; the same command then resumes and ends with the weights of a run never interrupted.

Two run directories, each stopped and run again with the same command, then completed, beside
an uninterrupted reference of each (two commands at a time: each spends most of its time
starting; the references are their rank code, on ranks from this process's fork server or, for
one rank, in this process, and so is the 2-rank case's completing run):
- 2ranks (async checkpoints): SIGUSR1 (SLURM's `--signal=USR1@T`) while the ranks are still
  starting, so the run stops after its first step; then, in the resumed run, SIGTERM once
  training is under way; the launcher's elastic agent forwards both to the ranks.
- 1rank: SIGTERM once training is under way, to the one rank training in the launcher itself.
The command signalled in start-up runs as typed; the others fork from the session's process
that has imported composerun (as conftest's `cli` runs it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import _forks as forks
from conftest import final_weights, latest_name, patience, read_metrics, run_two_at_a_time, train
from test_kill import group_members

from composerun.errors import PREEMPTED_EXIT_CODE, Preempted

PROG = str(Path(sys.executable).with_name("composerun"))
STEPS = 40  # enough that a signal sent after a logged step lands well before the end
MODEL = ("+model=unit", "model.dim=16")
BASE = (*MODEL, f"train.steps={STEPS}", "hydra.run.dir=run")
RUN_TIMEOUT = patience(150)  # seconds for one run to end (a hang guard)
WAIT_TIMEOUT = 120  # seconds to wait for the moment to send the signal

LINE = re.compile(
    r"composerun: preempted \((SIG\w+)\) at step (\d+): checkpoint saved to (\S+); "
    r"run the same command with hydra\.run\.dir=(\S+) to resume"
)

# name: (the command's overrides, the signals sent to its successive runs and when, its reference)
CASES: dict[str, tuple[tuple[str, ...], list[tuple[signal.Signals, str]], str]] = {
    "2ranks": (
        ("mesh=2", "checkpoint.async=true", "checkpoint.every=5"),
        [(signal.SIGUSR1, "startup"), (signal.SIGTERM, "training")],
        "reference_2ranks",
    ),
    "1rank": (("mesh=1",), [(signal.SIGTERM, "training")], "reference_1rank"),
}
REFERENCES = {"reference_2ranks": ("mesh=2",), "reference_1rank": ("mesh=1",)}
STOPS = [(name, i) for name, case in CASES.items() for i in range(len(case[1]))]


# --- processes ---------------------------------------------------------------------------------


def start(cwd: Path, args: tuple[str, ...], tag: str, procs: list[Any], typed: bool = False) -> Any:
    """`composerun ARGS` in a session of its own (so that its whole process group can be checked):
    as typed (`typed`: the start signalled in start-up), else forked from the session's process
    that has imported composerun (conftest's `cli`; the signal waits for training under way)."""
    cwd.mkdir(parents=True, exist_ok=True)
    env, out, err = {**os.environ, "PYTHONWARNINGS": "ignore"}, cwd / f"{tag}.out", cwd / f"{tag}.err"
    if not typed:
        procs.append(forks().start("composerun", [*BASE, *args], cwd, env, out, err))
        return procs[-1]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [PROG, *BASE, *args], cwd=cwd, env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    procs.append(proc)
    return proc


def finish(proc: subprocess.Popen, cwd: Path, tag: str) -> dict[str, Any]:
    """Wait for the run to end; its exit code, stderr, stdout and what is left of its group."""
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{cwd}: {tag} did not end in {RUN_TIMEOUT} s") from None
    deadline = time.monotonic() + patience(10)
    while (left := group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {
        "rc": rc,
        "err": (cwd / f"{tag}.err").read_text(),
        "out": (cwd / f"{tag}.out").read_text(),
        "left": left,
    }


def wait_for(proc: subprocess.Popen, what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_TIMEOUT
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {WAIT_TIMEOUT} s")


def last_logged_step(run: Path) -> int:
    """The step of the last whole row in metrics.jsonl (0 if none)."""
    path = run / "metrics.jsonl"
    rows = [ln for ln in path.read_text().split("\n")[:-1] if ln] if path.is_file() else []  # [:-1]: one being written
    return json.loads(rows[-1])["step"] if rows else 0


def moment(run: Path, when: str, t_start: float) -> tuple[str, Callable[[], bool]]:
    """What to wait for before sending the signal, in a run started at `t_start`."""
    if when == "startup":  # rank 0 writes plan.json after every rank set its handlers, before step 1
        plan = run / "plan.json"
        return "plan.json of this run", lambda: plan.is_file() and plan.stat().st_mtime >= t_start
    before = last_logged_step(run)  # the run directory may hold an earlier run's rows
    return "a step logged by this run", lambda: last_logged_step(run) > before


# --- the runs ----------------------------------------------------------------------------------


def preempt(cwd: Path, args: tuple[str, ...], sig: signal.Signals, when: str, tag: str, procs) -> dict[str, Any]:
    """Start the command, send `sig` to the launcher at `when`; what the stopped run left."""
    run = cwd / "run"
    t_start = time.time()
    proc = start(cwd, args, tag, procs, typed=when == "startup")
    wait_for(proc, *moment(run, when, t_start))
    seen = last_logged_step(run)
    os.kill(proc.pid, sig)  # the launcher only, as `kill -TERM PID` or a scheduler does
    stopped = finish(proc, cwd, tag)
    root = run / "checkpoints"
    latest = latest_name(root)
    stopped.update(
        step_seen=seen,
        summary=json.loads((run / "summary.json").read_text()),
        latest=latest,
        # read now: a later run's retention (checkpoint.keep) removes it
        latest_complete=bool(latest) and all((root / latest / f).is_file() for f in ("manifest.json", ".metadata")),
        tmp_left=sorted(p.name for p in root.glob("*.tmp-*")),
        rows=read_metrics(run),
    )
    return stopped


# The 2-rank case's completing run is its rank code on ranks from this process's fork server (in
# the main thread, after the commands): the command itself resuming from a preemption's checkpoint
# is the 2-rank case's second stop (it resumed from the first) and the 1-rank case's completing run.
FORKED_FINAL = "2ranks"


def preempt_then_complete(cwd: Path, name: str, procs: list[subprocess.Popen]) -> dict[str, Any]:
    args, signals, _ = CASES[name]
    stops = [preempt(cwd, args, sig, when, f"stop{i}", procs) for i, (sig, when) in enumerate(signals)]
    if name == FORKED_FINAL:
        return {"stops": stops}
    done = finish(start(cwd, args, "final", procs), cwd, "final")
    done["summary"] = json.loads((cwd / "run" / "summary.json").read_text())
    return {"stops": stops, "final": done}


def forked_reference(cwd: Path, name: str) -> dict[str, Any]:
    """The reference's rank code on ranks from this process's fork server, or its one rank in
    this process (not the command: the weights are what is compared; a command's one rank
    computes with the thread this process has, OMP_NUM_THREADS=1 passed on); in this thread,
    as the elastic agent sets signal handlers."""
    train(cwd / "run", *MODEL, f"train.steps={STEPS}", *REFERENCES[name])
    return {"rc": 0, "err": ""}


def forked_final(cwd: Path, name: str) -> dict[str, Any]:
    """The completing run of case `name` on ranks from this process's fork server."""
    try:
        train(cwd / "run", *MODEL, f"train.steps={STEPS}", *CASES[name][0])
    except Exception:  # noqa: BLE001 - for the test that needs it to report
        return {"rc": "failed", "err": traceback.format_exc()}
    return {"rc": 0, "err": "", "summary": json.loads((cwd / "run" / "summary.json").read_text())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case, two at a time, the references meanwhile; each one's record or error."""
    root = tmp_path_factory.mktemp("preempt")
    procs: list[subprocess.Popen] = []
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda name=name: preempt_then_complete(root / name, name, procs)) for name in CASES
    }
    out: dict[str, Any] = {"root": root}
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            rest = pool.submit(run_two_at_a_time, jobs)
            for name in REFERENCES:
                try:
                    out[name] = forked_reference(root / name, name)
                except Exception as e:  # noqa: BLE001 - for the test that needs it to report
                    out[name] = e
            out.update(rest.result())
        if not isinstance(out[FORKED_FINAL], Exception):
            out[FORKED_FINAL]["final"] = forked_final(root / FORKED_FINAL, FORKED_FINAL)
    finally:
        for proc in procs:  # nothing outlives the module, whatever failed
            if group_members(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
    print(f"\npreemption runs: {time.monotonic() - t0:.1f} s in all")
    return out


def record(runs: dict[str, Any], name: str) -> dict[str, Any]:
    if isinstance(runs[name], Exception):
        raise runs[name]
    return runs[name]


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("name", "i"), STOPS, ids=[f"{n}-{CASES[n][1][i][0].name}-{CASES[n][1][i][1]}" for n, i in STOPS]
)
def test_preempted_run_checkpoints_and_exits(name: str, i: int, runs: dict[str, Any]) -> None:
    stops = record(runs, name)["stops"]
    r = stops[i]
    run = runs["root"] / name / "run"
    sig, when = CASES[name][1][i]
    assert r["rc"] == PREEMPTED_EXIT_CODE, f"exit {r['rc']} (a run that ended first exits 0):\n{r['err'][-3000:]}"
    assert "Traceback" not in r["err"] + r["out"]
    lines = [ln for ln in r["err"].splitlines() if ln.strip()]
    assert len(lines) == 1, r["err"]
    m = LINE.fullmatch(lines[0])
    assert m, lines[0]
    signame, step, ckpt, run_dir = m.group(1), int(m.group(2)), Path(m.group(3)), Path(m.group(4))
    assert signame == sig.name and run_dir == run.resolve()
    # it stopped after the step it was in when the signal came, with that step published
    assert max(1, r["step_seen"]) <= step < STEPS
    if when == "startup":  # sent before any step was logged; it reaches the ranks through the launcher,
        # in step 1 or, on a busy machine, in step 2 (each step is read: the stop is agreed at once)
        assert r["step_seen"] == 0 and step <= 2, "a signal in start-up stops the run after its first steps"
    assert ckpt == run.resolve() / "checkpoints" / f"step-{step:08d}"
    assert r["latest"] == ckpt.name and r["latest_complete"]
    assert not r["tmp_left"], "a preempted run leaves no partial checkpoint"
    assert r["rows"][-1]["step"] == step
    s = r["summary"]
    assert s["status"] == "preempted" and s["preempted_at_step"] == step and Path(s["checkpoint"]) == ckpt
    if i > 0:  # preempted again after a resume: it had resumed from the previous stop
        assert s["resumed_from"] == stops[i - 1]["summary"]["checkpoint"]
    assert not r["left"], f"processes left: {r['left']}"


@pytest.mark.e2e
@pytest.mark.parametrize("name", CASES)
def test_restart_completes_with_the_uninterrupted_weights(name: str, runs: dict[str, Any]) -> None:
    r = record(runs, name)
    ref = record(runs, CASES[name][2])
    assert ref["rc"] == 0, ref["err"][-3000:]
    assert r["final"]["rc"] == 0, r["final"]["err"][-3000:]
    last_stop, s = r["stops"][-1]["summary"], r["final"]["summary"]
    assert s["status"] == "ok" and s["resumed_from"] == last_stop["checkpoint"]
    assert s["start_step"] == last_stop["preempted_at_step"]
    got = final_weights(runs["root"] / name / "run", *MODEL)
    want = final_weights(runs["root"] / CASES[name][2] / "run", *MODEL)
    assert list(got) == list(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype and got[key].numpy().tobytes() == w.numpy().tobytes(), key


def stopped_line(*args: object) -> str:
    return str(Preempted(*args))


def test_stopped_line_says_how_to_go_on(tmp_path: Path) -> None:
    """The hint adds checkpoint.resume=auto only where the same command would not resume."""
    ckpt = str(tmp_path / "checkpoints" / "step-00000007")
    line = stopped_line(tmp_path, 7, ckpt, "auto", "SIGUSR1")
    assert line == (
        f"preempted (SIGUSR1) at step 7: checkpoint saved to {ckpt}; "
        f"run the same command with hydra.run.dir={tmp_path} to resume"
    )
    assert stopped_line(tmp_path, 7, ckpt, "never", None).endswith(f"{tmp_path} checkpoint.resume=auto to resume")
    # no checkpoint at all (checkpoint=none, or stopped in start-up): nothing to resume from
    assert stopped_line(tmp_path, None, None, "never", "SIGTERM") == (
        f"preempted (SIGTERM) before a checkpoint could be written: no checkpoint; "
        f"run the same command with hydra.run.dir={tmp_path} to start again"
    )


def test_ctrl_c_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops the ranks at
    once, with no checkpoint of its own: one line that says where to resume from, exit 130,
    no traceback, no process left."""
    err = tmp_path / "c.err"
    with open(err, "w") as errf:
        proc = subprocess.Popen(
            [PROG, *MODEL, "mesh=2", "train.steps=100000", "checkpoint.every=5", "hydra.run.dir=run"],
            cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.DEVNULL, stderr=errf,
            stdin=subprocess.DEVNULL, start_new_session=True,
            # a shell's background job ignores SIGINT, and its children inherit that: not this one
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    try:
        wait_for(proc, "a checkpoint", lambda: (tmp_path / "run" / "checkpoints" / "latest").exists())
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err.read_text()
    assert rc == 128 + signal.SIGINT, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    (line,) = [ln for ln in text.splitlines() if ln.startswith("composerun:")]
    assert re.fullmatch(
        r"composerun: interrupted \(SIGINT\): the ranks were stopped; run the same command with "
        r"hydra\.run\.dir=\S+/run to resume from \S+/run/checkpoints/step-\d{8}",
        line,
    ), line
    deadline = time.monotonic() + patience(10)
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_members(proc.pid)


# `kill -TERM -- -PGID` (a scheduler or a shell stopping the whole job): one "preempted" line on the
# console and in rank0.log, exit 75, the step's checkpoint: the catalog's g02 (scripts/bad_inputs.py).


def test_a_rank_forked_after_its_launcher_stopped_prints_no_traceback() -> None:
    """A job's signal in its first seconds can stop the launcher while the fork server forks a
    rank; that rank finds the launcher's semaphores removed as it reads its start-up state, and
    the fork server printed its FileNotFoundError traceback after the launcher's own line.  The
    fork server's excepthook (composerun/launch/forkserver.py, imported in a process of its own:
    it ignores the job's signals) drops that error alone."""
    code = (
        "import sys, multiprocessing.synchronize as s\n"
        "import composerun.launch.forkserver\n"
        "for state in [(0, 1, 1, '/mp-composerun-removed')]:\n"  # a semaphore no longer there
        "    try:\n"
        "        s.Lock.__new__(s.Lock).__setstate__(state)\n"
        "    except Exception:\n"
        "        sys.excepthook(*sys.exc_info())\n"
        "try:\n"
        "    raise ValueError('a rank that really failed to start')\n"
        "except Exception:\n"
        "    sys.excepthook(*sys.exc_info())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "FileNotFoundError" not in r.stderr, r.stderr
    assert "ValueError: a rank that really failed to start" in r.stderr  # any other error still shows


def test_a_ctrl_c_while_torch_is_imported_is_acted_on_once_it_is() -> None:
    """launch/signals.py interrupt_deferred, around the launcher's import of torch (which drops a
    KeyboardInterrupt raised inside its start-up: catalog case g08 saw the run go on to the end,
    exit 0): a SIGINT in the block raises KeyboardInterrupt when the block ends, not in it, and
    the handler is Python's default again."""
    import os
    import signal

    from composerun.launch.signals import interrupt_deferred

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test worker may ignore it)
    try:
        went_on = []
        with pytest.raises(KeyboardInterrupt):
            with interrupt_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(10_000))  # Python runs handlers between bytecodes: here, if at all
                went_on.append(True)
        assert went_on == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_fork_server_starts_with_the_groups_signals_held() -> None:
    """launch/agent.py prestart_fork_server, in a process where no resource tracker runs yet (a
    first command): the fork server's interpreter is started with SIGINT and SIGTERM held, so
    that a Ctrl-C while it imports cannot end it with a traceback.  Python's start of the fork
    server first starts the resource tracker, which unblocks both when it has started: catalog
    case g08 caught the fork server started with neither held (seen with strace)."""
    code = (
        "import signal, sys\n"
        "from multiprocessing import util, resource_tracker\n"
        "real, held = util.spawnv_passfds, []\n"
        "def spawn(path, args, passfds):\n"
        "    what = 'forkserver' if any(b'multiprocessing.forkserver' in (a if isinstance(a, bytes) else a.encode())"
        " for a in args) else 'resource_tracker'\n"
        "    held.append((what, sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, set()))))\n"
        "    return real(path, args, passfds)\n"
        "util.spawnv_passfds = spawn\n"
        "assert resource_tracker._resource_tracker._fd is None  # (none runs yet)\n"
        "from composerun.config.schema import LaunchConfig\n"
        "from composerun.launch import agent\n"
        # the fork server preloads its first module alone: what is watched is each helper's start,
        # not the imports that follow it (torch's, which the fork server would finish before exiting)
        "agent.RANK_MODULES = agent.RANK_MODULES[:1]\n"
        "agent.prestart_fork_server(LaunchConfig(), 2)\n"
        "print(held)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    held = dict(eval(r.stdout.strip().splitlines()[-1]))  # noqa: S307 - our own printout
    assert held == {"resource_tracker": ["SIGINT", "SIGTERM"], "forkserver": ["SIGINT", "SIGTERM"]}, held
