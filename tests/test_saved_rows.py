"""A run killed the moment a checkpoint becomes the one the next run resumes from loses no
metrics row: the row of the step it saved is in metrics.jsonl already, so the same command
again leaves one row for every step, each step once.

A save becomes the resume point when every rank has recorded its files in the save's tmp
folder (start-up publishes such a save: checkpoint/recovery.py), or when it is published.
The ranks here die (`os._exit`, as SIGKILL would: no clean-up) at exactly one of those two
moments of the step-8 save.  For an async save, rank 0's metrics write is made slow (it
waits for the save's record of rank 0 to appear): a record that does not wait for the row
lets the run die with the row unwritten.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import patience, read_metrics, train
from test_checkpoint import BASE

from composerun.checkpoint import checkpointer
from composerun.errors import RunFailed
from composerun.train import metrics

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

STEPS, CRASH = 12, 8
ARGS = (*BASE, "mesh=2", f"train.steps={STEPS}", "checkpoint.every=4", "launch.omp_threads=1")
SHARES = ("manifest.rank0.json", "manifest.rank1.json")


def shares_of(run: Path, names: tuple[str, ...]) -> bool:
    """Whether the tmp folder of the step-CRASH save holds every one of `names`."""
    return any(all((tmp / n).is_file() for n in names) for tmp in (run / "checkpoints").glob(f"step-{CRASH:08d}.tmp-*"))


def wait_for_shares(run: Path, names: tuple[str, ...], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not shares_of(run, names) and time.monotonic() < deadline:
        time.sleep(0.005)
    return shares_of(run, names)


def crash_when(monkeypatch: pytest.MonkeyPatch, run: Path, moment: str) -> None:
    """Every rank exits at `moment` of the step-CRASH save: once every rank's record is in
    its tmp folder ("recorded"), or once it is published ("published")."""
    name = "_record" if moment == "recorded" else "_publish"
    real = getattr(checkpointer.Checkpointer, name)

    def crash(self, *args) -> None:
        real(self, *args)
        if args[-1] == CRASH:
            if moment == "recorded":
                assert wait_for_shares(run, SHARES, patience(30)), "a rank never recorded its files"
            os._exit(3)

    monkeypatch.setattr(checkpointer.Checkpointer, name, crash)


def slow_row_write(monkeypatch: pytest.MonkeyPatch, run: Path) -> None:
    """Rank 0 writes the row of step CRASH only once rank 0's record of the save is there
    (or 2 s have passed), and then only after a pause: whatever may happen before the row is
    written, happens."""
    real = metrics.Metrics.log

    def log(self, row) -> None:
        if row["step"] == CRASH:
            if wait_for_shares(run, SHARES[:1], 2.0):
                time.sleep(patience(5))  # a crash at the record ends the process meanwhile
        real(self, row)

    monkeypatch.setattr(metrics.Metrics, "log", log)


@pytest.mark.parametrize(
    ("moment", "mode"),
    [("recorded", "sync"), ("published", "sync"), ("recorded", "async")],
    ids=["recorded-sync", "published-sync", "recorded-async"],
)
def test_a_run_killed_as_its_save_commits_keeps_that_steps_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str, mode: str
) -> None:
    run = tmp_path / "run"
    args = (*ARGS, f"checkpoint.async={str(mode == 'async').lower()}")
    with monkeypatch.context() as mp:
        crash_when(mp, run, moment)
        if mode == "async":
            slow_row_write(mp, run)
        with pytest.raises(RunFailed):
            train(run, *args, start_method="fork")

    summary = train(run, *args, start_method="fork")
    # the crash hit the moment meant: the step-CRASH save is what the same command resumed from
    assert Path(summary["resumed_from"]).name == f"step-{CRASH:08d}", summary["resumed_from"]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "metrics.jsonl is not one row for every step"
    saved = [r["step"] for r in rows if "checkpoint_stall_s" in r]
    assert saved == [4, 8, 12], f"the rows of the steps that saved: {saved}"
