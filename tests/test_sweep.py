"""End-to-end: a sweep through the CLI, its report, and composerun-report.

One sweep serves every test here: 1 and 2 ranks x FSDP and HSDP x a learning rate that trains
and one that overflows.  HSDP on a 1-D mesh is skipped, the overflowing jobs fail, and the
report is written all the same.  (A sweep whose every job succeeds gets its report from Hydra's
end-of-sweep callback instead: tests/test_estimate.py's sweep of plans, scripts/bad_inputs.py s04.)
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import cli

pytestmark = pytest.mark.e2e

GOOD, BAD = "0.01", "1e30"


def report(target: Path) -> tuple[int, str, str]:
    """`composerun-report TARGET` in this process, through the function the console script calls
    (the script as typed: tests/test_ckpt_cli.py): (exit code, stdout, stderr)."""
    from composerun.report import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(target)])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sweep as typed, then composerun-report on it (its summary.csv removed first), on a
    folder without runs and on a missing one."""
    root = tmp_path_factory.mktemp("sweep")
    r = cli(
        "-m", "+model=composite", "model.dim=16", "mesh=1,2", "sharding=fsdp,hsdp", f"optim.lr={GOOD},{BAD}",
        "train.steps=2", "metrics.progress=false", "hydra.sweep.dir=sweep", cwd=root, timeout=400,
    )  # fmt: skip
    table = root / "sweep" / "summary.csv"
    first = list(csv.DictReader(table.open())) if table.is_file() else []
    table.unlink(missing_ok=True)
    (root / "empty").mkdir()
    return {
        "root": root,
        "run": r,
        "rows": first,
        "report": {target: report(root / target) for target in ("sweep", "empty", "missing")},
    }


def test_sweep_runs_every_cell_skips_impossible_ones_and_reports(sweep: dict[str, Any]) -> None:
    """2 meshes x 2 policies x 2 learning rates: HSDP on a 1-D mesh is skipped with its reason,
    the rest run (each with its own ranks and run dir), and the report lists all eight."""
    r, root = sweep["run"], sweep["root"]
    rows = sweep["rows"]
    assert [row["run"] for row in rows] == [str(k) for k in range(8)], r.stderr[-3000:]
    for k, row in enumerate(rows):  # job k: the product of the sweep's lists, the last varying fastest
        mesh, policy, lr = "12"[k // 4], ("fsdp", "hsdp")[k // 2 % 2], (GOOD, BAD)[k % 2]
        if policy == "hsdp":
            assert row["status"] == "skipped" and "HSDP needs a 2-D mesh" in row["reason"], row
        elif lr == GOOD:
            assert row["status"] == "ok" and float(row["final_loss"]) > 0 and float(row["samples_per_s"]) > 0, row
        else:
            assert row["status"] == "failed" and "loss is" in row["reason"] and "(now 1e+30)" in row["reason"], row
        assert (row["model"], row["mesh"], row["policy"]) == ("composite", mesh, policy), row
    assert (root / "sweep" / "summary.md").read_text().count("| skipped |") == 4
    # the sweep's wall time against the sum of its jobs' own: how the figures relate, never
    # how long anything took (a timed assertion fails on a busy machine)
    timing = json.loads((root / "sweep" / "sweep.json").read_text())
    assert timing["jobs"] == 8 and timing["status"] == "2 failed, 2 ok, 4 skipped"
    job_walls = [json.loads(p.read_text()).get("job_wall_s") or 0.0 for p in (root / "sweep").glob("*/summary.json")]
    assert len(job_walls) == 8 and timing["jobs_wall_s"] == pytest.approx(sum(job_walls), rel=1e-12)
    assert timing["overhead"] == pytest.approx(timing["wall_s"] / timing["jobs_wall_s"] - 1, rel=1e-12)
    assert all(float(row["job_wall_s"]) > 0 for row in rows if row["status"] == "ok")
    assert "composerun: sweep of 8 jobs (2 failed, 2 ok, 4 skipped)" in r.stdout
    for png in ("loss_curves.png", "throughput_memory.png"):
        assert (root / "sweep" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # composerun-report rebuilds the same table from the directories alone
    code, _, err = sweep["report"]["sweep"]
    assert code == 0, err
    again = list(csv.DictReader((root / "sweep" / "summary.csv").open()))
    assert [(row["run"], row["status"]) for row in again] == [(row["run"], row["status"]) for row in rows]


def test_report_on_a_folder_without_runs(sweep: dict[str, Any]) -> None:
    for target, expected in [("empty", "holds no run"), ("missing", "no such directory")]:
        code, _, err = sweep["report"][target]
        assert code == 2
        (line,) = err.strip().splitlines()
        assert line.startswith("composerun-report: error: ") and expected in line


def test_a_failed_job_still_gets_the_sweep_report(sweep: dict[str, Any]) -> None:
    """Hydra runs every job, then raises the first failure without its end-of-sweep
    callback: the report is written all the same, the failed jobs in it (one on 1 rank, one on
    2), and the command's last line is the first failure's."""
    r = sweep["run"]
    assert r.returncode == 1, r.stderr[-2000:]
    failed = [row["run"] for row in sweep["rows"] if row["status"] == "failed"]
    assert failed == ["1", "5"]  # the overflowing learning rate on 1 rank and on 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("composerun: error: ") and "loss" in last, last
    assert last.endswith("(a job of the sweep; the sweep's report: sweep/summary.md)")
