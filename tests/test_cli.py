"""End-to-end: the `composerun` CLI as a user types it, in a fresh working directory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, cli, cli_into_closed_pipe

pytestmark = pytest.mark.e2e

FINISHED_MARKS = ("summary.json", "metrics.jsonl", "checkpoints", "plan.json")


# The README's main command (`composerun +model=composite mesh=2x4`: 8 local ranks, one run
# directory with every artifact, the done line, its plan against plan=true's) and its torchrun
# twin (one run directory, one .hydra/) are read closely where the README's own commands run:
# tests/test_readme.py (test_the_readmes_first_command_self_launches_8_ranks_into_one_run_dir,
# test_torchrun_ranks_share_one_run_dir).


# One 1-rank run, typed as `python -m composerun`, that three tests read: the command itself,
# its TensorBoard events, and the same command again (as `composerun`) with nothing to do.
ONE_RANK = ("+model=unit", "model.dim=8", "train.steps=3", "metrics.tensorboard=true", "checkpoint.export=safetensors")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("one_rank")
    r = cli(*ONE_RANK, "hydra.run.dir=run", cwd=cwd, prog=[sys.executable, "-m", "composerun"])
    return cwd / "run", r


def test_python_dash_m_runs_in_process(one_rank: tuple[Path, subprocess.CompletedProcess]) -> None:
    """`python -m composerun` works too; a 1-rank run needs no launcher."""
    run, r = one_rank
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    assert not (run / "torchelastic").exists()


# A user's mistake is one line and exit 2, no traceback, no run left behind: the catalog
# (scripts/bad_inputs.py) holds the cases (an unknown model c10, mesh m01/m09, zero-rank meshes
# m02/m10/m11, a sweep value that is not a choice s03, negative steps c01, a misspelt key c28, a
# non-numeric lr c38); this one runs without hydra.run.dir (Hydra's outputs/DATE/TIME).
BAD_INPUT = {
    "no model": ((), "no model chosen: add +model=NAME"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    """A user's mistake: exit code 2, one line naming the key, no traceback, no run left behind."""
    args, expected = BAD_INPUT[case]
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("composerun: error: "), r.stderr
    assert expected in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    outputs = tmp_path / "outputs"
    left = [p for p in outputs.rglob("*") if p.name in FINISHED_MARKS] if outputs.exists() else []
    assert left == []
    assert not (tmp_path / "multirun").exists() or not any((tmp_path / "multirun").rglob("*.yaml"))
    if case == "no model":
        assert "composite" in lines[0] and "_schema" not in lines[0]


def test_mesh_not_world_size_under_torchrun(tmp_path: Path) -> None:
    """torchrun with 2 ranks but mesh=2x2: every rank exits 2; composerun says why once.

    torchrun itself then prints its own ChildFailedError report (its traceback, not ours)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    r = cli(
        "--nproc_per_node",
        "2",
        "-m",
        "composerun",
        "+model=unit",
        "mesh=2x2",
        cwd=tmp_path,
        prog=[torchrun],
        timeout=180,
    )
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert out.count("composerun: error: mesh 2x2 needs 2 * 2 = 4 ranks but WORLD_SIZE is 2") == 1
    assert "exitcode: 2" in out
    assert "composerun/" not in "".join(ln for ln in out.splitlines() if ln.lstrip().startswith("File "))
    outputs = tmp_path / "outputs"
    assert not [p for p in outputs.rglob("*") if p.name in FINISHED_MARKS] if outputs.exists() else True


def test_one_dead_rank_stops_the_run(tmp_path: Path) -> None:
    """A rank that raises takes the whole run down promptly; the message names the rank and cause."""
    r = cli(
        "+model=unit", "model._target_=faulty.FailsOnRank", "model.dim=8", "mesh=2", "train.steps=100000",
        "hydra.run.dir=run", cwd=tmp_path, env={"PYTHONPATH": str(REPO / "tests" / "fixtures")}, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("composerun: error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 2" in lines[0]
    assert "Traceback" not in r.stderr
    assert "injected failure" in (tmp_path / "run" / "rank1.log").read_text()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_tensorboard_events_when_asked(one_rank: tuple[Path, subprocess.CompletedProcess]) -> None:
    """metrics.tensorboard=true writes event files TensorBoard reads back, one point per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, r = one_rank
    assert r.returncode == 0, r.stderr[-2000:]
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert {"loss", "grad_norm", "lr", "step_s"} <= set(acc.Tags()["scalars"])


# A run directory that cannot be created (e05), a checkpoints/ that is a file (k21), a resume path
# that does not exist (k01), an empty hydra.run.dir or hydra.sweep.dir (e06, e14, e15), a model
# that cannot be imported (c17, c39): one exact line each, in the catalog (scripts/bad_inputs.py).


def test_the_failed_rank_is_named_not_the_peer_that_lost_it() -> None:
    """Error files carry whole-second timestamps: the rank that raised and the rank that then
    lost it inside a collective often tie, and torch's first failure is then the lower rank."""
    from types import SimpleNamespace

    from composerun.launch.agent import _failure_line

    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    failures = {
        0: SimpleNamespace(message={"message": gloo}, timestamp=100, exitcode=1),
        1: SimpleNamespace(message={"message": "RuntimeError: injected failure"}, timestamp=100, exitcode=1),
        2: SimpleNamespace(message={"message": "ValueError: later"}, timestamp=101, exitcode=1),
    }
    assert _failure_line(SimpleNamespace(failures=failures)) == (1, "RuntimeError", "injected failure")
    only_peers = {r: f for r, f in failures.items() if r == 0}
    assert _failure_line(SimpleNamespace(failures=only_peers))[0] == 0


def test_a_half_written_error_file_of_a_stopped_rank_is_skipped(tmp_path: Path) -> None:
    """The agent stops the other ranks once one fails; one it stopped while it was writing its
    error file leaves that file empty or cut short.  The report still names the failed rank."""
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from composerun.launch.agent import _failure_line

    for local in range(4):
        (tmp_path / str(local)).mkdir()
    report = {
        "message": {"message": "RuntimeError: injected failure", "extraInfo": {"timestamp": str(int(time.time()))}}
    }
    (tmp_path / "1" / "error.json").write_text(json.dumps(report))
    (tmp_path / "0" / "error.json").write_text("")  # truncated by open(), then stopped
    (tmp_path / "2" / "error.json").write_text(json.dumps(report)[:20])  # stopped mid-write
    (tmp_path / "3" / "error.json").write_text("{}")  # no message at all
    failed = ProcessFailure(local_rank=1, pid=0, exitcode=1, error_file=str(tmp_path / "1" / "error.json"))
    assert _failure_line(SimpleNamespace(failures={1: failed})) == (1, "RuntimeError", "injected failure")


def test_help_into_a_closed_pipe_is_no_error(tmp_path: Path) -> None:
    """`composerun --help | head`: the reader has what it wanted; no error, status 0 (the
    other console scripts: tests/test_ckpt_cli.py)."""
    rc, err = cli_into_closed_pipe("--help", cwd=tmp_path, prog=[str(Path(sys.executable).with_name("composerun"))])
    assert (rc, err) == (0, ""), f"{rc}: {err[-1500:]}"


def test_a_broken_pipe_of_its_own_is_still_an_error() -> None:
    """Only a closed stdout or stderr is the reader's doing; a pipe to a rank that broke is not."""
    from composerun.console import quiet_on_closed_pipe

    @quiet_on_closed_pipe
    def main() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        main()


def test_a_finished_run_with_its_export_has_nothing_to_do(one_rank: tuple[Path, subprocess.CompletedProcess]) -> None:
    """The same command again, checkpoint.export included: the export is there, from the same
    checkpoint; no rank starts and nothing is rewritten."""
    run, first = one_rank
    assert first.returncode == 0, first.stderr[-2000:]
    export = run / "export" / "model.safetensors"
    before = (export.stat().st_mtime_ns, (run / "rank0.log").read_text())
    r = cli(*ONE_RANK, "hydra.run.dir=run", cwd=run.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already trained 3 steps (nothing to do)" in r.stdout and f"exported to {export}" in r.stdout
    assert (export.stat().st_mtime_ns, (run / "rank0.log").read_text()) == before


def test_the_done_lines_clock_starts_with_the_command_not_the_shell_that_execd_it() -> None:
    """`bash -c "pip install . && composerun ..."` runs composerun in the shell's own process
    (bash execs its last command), which started before the install: the command's time counts
    from Python's import of composerun then, not from the process's start."""
    code = (
        "import time, composerun; from composerun.launch.timing import command_started, process_started; "
        "print(time.time() - command_started(False), time.time() - process_started())"
    )
    r = subprocess.run(["bash", "-c", f"sleep 3; exec {sys.executable} -c '{code}'"], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    command, process = map(float, r.stdout.split())
    assert process >= 3 and command < 2, (command, process)
    # a command forked and exec'd as a terminal starts it: the process's start, its interpreter's start-up included
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    command, process = map(float, r.stdout.split())
    assert command == pytest.approx(process, abs=0.05), (command, process)
