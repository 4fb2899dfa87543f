"""End-to-end: `plan=true` plans any mesh in one process on torch's fake process group.

That the planner's plan.json equals a real run's is checked for every policy cell on
meshes 2 and 2x2 (tests/test_policies.py) and for the README's 2x4 run (tests/test_cli.py).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import cli

pytestmark = pytest.mark.e2e


def test_plan_512_ranks_in_one_process(tmp_path: Path) -> None:
    """HSDP on 8x64: every rank's shards, the empty ones included, without starting a rank."""
    r = cli("+model=composite", "mesh=8x64", "sharding=hsdp", "plan=true", "hydra.run.dir=plan", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["world_size"] == 512 and plan["mesh"] == "8x64" and plan["mesh_dims"] == ["replicate", "shard"]
    l1 = next(u for u in plan["units"] if u["fqn"] == "l1")
    weight = next(p for p in l1["params"] if p["name"] == "l1.weight")
    # 100 rows in 64 shards of ceil(100/64) = 2: shards 0-49 hold 2 rows, 50-63 none; the 8 replicas repeat them
    assert weight["local_shape_per_rank"][:64] == [[2, 100]] * 50 + [[0, 100]] * 14
    assert weight["local_shape_per_rank"][64:128] == weight["local_shape_per_rank"][:64]
    held = [sum(plan["bytes_per_rank"][k][r] for k in ("params", "grads", "optim")) for r in range(512)]
    assert plan["largest_rank"] == {"rank": 0, "bytes": max(held)}
    assert plan["smallest_rank"] == {"rank": 50, "bytes": 0}
    comm = plan["comm_per_step"]
    assert comm["all_gather"] > comm["reduce_scatter"] > comm["all_reduce"] > 0
    summary = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert summary["status"] == "planned" and summary["planned_ranks"] == 2  # 2 rows, or none
    assert "plan: composite on mesh 8x64 (512 ranks), policy hsdp" in r.stdout
    assert "largest shards: rank 0" in r.stdout and "per step: all-gather" in r.stdout
    assert not (tmp_path / "plan" / "metrics.jsonl").exists() and not (tmp_path / "plan" / "checkpoints").exists()


def test_the_plan_table_is_in_the_models_order(tmp_path: Path) -> None:
    """Blocks in the model's order, whichever rules matched them (activation checkpointing on
    every 2nd); one rank is "1 rank"."""
    r = cli(
        "+model=transformer",
        "sharding=fsdp_blocks_ac",
        "plan=true",
        "plan.estimate=false",
        "hydra.run.dir=p",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(("blocks.", "<root>"))]
    assert rows == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "<root>"]
    assert "plan: transformer on mesh 1 (1 rank), policy fsdp_blocks_ac" in r.stdout
    assert "composerun: plan: 1 rank from 1 distinct shard layout in " in r.stdout


def test_a_sweep_of_plans_is_reported(tmp_path: Path) -> None:
    """Layouts compared without ranks: a plan sweep gets the sweep report, bytes per rank per layout."""
    r = cli(
        "-m", "+model=composite", "mesh=2x2,4x16", "sharding=fsdp,hsdp", "plan=true", "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "sweep" / "summary.csv").open()))
    assert {(row["mesh"], row["policy"], row["status"]) for row in rows} == {
        (m, p, "planned") for m in ("2x2", "4x16") for p in ("fsdp", "hsdp")
    }
    per_rank = {(row["mesh"], row["policy"]): float(row["bytes_per_rank"]) for row in rows}
    assert per_rank["4x16", "fsdp"] < per_rank["4x16", "hsdp"]  # 64-way shards beat 16-way ones
    # nothing trained: no empty loss and throughput plots, and no overhead against jobs that time nothing
    assert not list((tmp_path / "sweep").glob("*.png"))
    [line] = [x for x in r.stdout.splitlines() if x.startswith("composerun: sweep of 4 jobs (4 planned): ")]
    assert "overhead" not in line and "n/a" not in line, line


# SIGTERM while planning a big mesh stops it at once, one line, no run directory (g07); a mesh too
# big to plan is one line, exit 2 (m07): the catalog (scripts/bad_inputs.py).
