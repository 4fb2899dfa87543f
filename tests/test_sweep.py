"""End-to-end: a sweep through the CLI, its report, and composerun-report."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from conftest import cli

pytestmark = pytest.mark.e2e


def test_sweep_runs_every_cell_skips_impossible_ones_and_reports(tmp_path: Path) -> None:
    """2 models x 2 meshes x 2 policies: HSDP on a 1-D mesh is skipped with its reason, the
    rest train (each with its own ranks and run dir), and the report lists all eight."""
    r = cli(
        "-m", "+model=unit,composite", "mesh=1,2", "sharding=fsdp,hsdp", "train.steps=2",
        "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = tmp_path / "sweep"
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(rows) == 8
    cells = {(row["model"], row["mesh"], row["policy"]): row for row in rows}
    assert set(cells) == {(m, mesh, p) for m in ("unit", "composite") for mesh in ("1", "2") for p in ("fsdp", "hsdp")}
    for (_, _, policy), row in cells.items():
        if policy == "hsdp":
            assert row["status"] == "skipped" and "HSDP needs a 2-D mesh" in row["reason"]
        else:
            assert row["status"] == "ok" and float(row["final_loss"]) > 0 and float(row["samples_per_s"]) > 0
    assert (sweep / "summary.md").read_text().count("| skipped |") == 4
    # the sweep's wall time against the sum of its jobs' own: how the figures relate, never
    # how long anything took (a timed assertion fails on a busy machine)
    timing = json.loads((sweep / "sweep.json").read_text())
    assert timing["jobs"] == 8 and timing["status"] == "4 ok, 4 skipped"
    job_walls = [json.loads(p.read_text()).get("job_wall_s") or 0.0 for p in sweep.glob("*/summary.json")]
    assert len(job_walls) == 8 and timing["jobs_wall_s"] == pytest.approx(sum(job_walls), rel=1e-12)
    assert timing["overhead"] == pytest.approx(timing["wall_s"] / timing["jobs_wall_s"] - 1, rel=1e-12)
    assert all(float(row["job_wall_s"]) > 0 for row in rows if row["status"] == "ok")
    assert "composerun: sweep of 8 jobs (4 ok, 4 skipped)" in r.stdout
    for png in ("loss_curves.png", "throughput_memory.png"):
        assert (sweep / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # composerun-report rebuilds the same table from the directories alone
    (sweep / "summary.csv").unlink()
    report = [str(Path(sys.executable).with_name("composerun-report"))]
    r = cli(str(sweep), cwd=tmp_path, prog=report)
    assert r.returncode == 0, r.stderr
    assert len(list(csv.DictReader((sweep / "summary.csv").open()))) == 8


def test_report_on_a_folder_without_runs(tmp_path: Path) -> None:
    report = [str(Path(sys.executable).with_name("composerun-report"))]
    (tmp_path / "empty").mkdir()
    for target, expected in [("empty", "holds no run"), ("missing", "no such directory")]:
        r = cli(target, cwd=tmp_path, prog=report)
        assert r.returncode == 2
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("composerun-report: error: ") and expected in line


def test_a_failed_job_still_gets_the_sweep_report(tmp_path: Path) -> None:
    """Hydra runs every job, then raises the first failure without its end-of-sweep
    callback: the report is written all the same, the failed job in it."""
    r = cli(
        "-m", "+model=composite", "model.dim=16", "mesh=1", "train.steps=2", "metrics.progress=false",
        "optim.lr=0.01,1e30", "hydra.sweep.dir=sweep", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    rows = {row["run"]: row for row in csv.DictReader((tmp_path / "sweep" / "summary.csv").open())}
    assert rows["0"]["status"] == "ok" and rows["1"]["status"] == "failed"
    assert "loss" in rows["1"]["reason"]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("composerun: error: ") and last.endswith(
        "(a job of the sweep; the sweep's report: sweep/summary.md)"
    )
    assert "composerun: sweep of 2 jobs (1 failed, 1 ok)" in r.stdout
