"""Policies whose units sit on different meshes (issue 19, item 6).

`mesh=2x2 sharding=fsdp_blocks sharding.rules.0.mesh_dims=[replicate,shard]` puts the
transformer's blocks on HSDP and its root (embeddings, norm, head) on one flat mesh of every
rank.  FSDP2 runs that; torch's gradient norm of DTensors on two meshes did not ("All operands
in aten.stack must have the same mesh" at step 1).  What torch truly cannot run (a sub-mesh
in another order than the mesh's) fails before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_close_weights, check_estimate, cli, compose, final_weights, read_metrics, train

from composerun.parallel.planner import plan_offline

COMMON = [
    "+model=transformer",
    "model.dim=32",
    "model.n_layers=2",
    "model.seq_len=8",
    "train.steps=4",
    "optim.grad_clip=0.5",  # below the grad norm (about 0.85): every step clips
    "metrics.progress=false",
]
ISSUE = ["mesh=2x2", "sharding=fsdp_blocks", "sharding.rules.0.mesh_dims=[replicate,shard]"]


@pytest.mark.distributed
def test_blocks_on_hsdp_under_a_flat_root_train_as_one_rank(tmp_path: Path) -> None:
    train(tmp_path / "one", *COMMON, "mesh=1", "sharding=none")
    summary = train(tmp_path / "mixed", *COMMON, *ISSUE)
    assert summary["status"] == "ok"
    one, mixed = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "mixed")
    assert [r["step"] for r in mixed] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in mixed] == pytest.approx([r[key] for r in one], rel=1e-5, abs=0), key
    assert min(r["grad_norm"] for r in mixed) > 0.5
    ov = [*COMMON, *ISSUE]
    assert_close_weights(final_weights(tmp_path / "mixed", *ov), final_weights(tmp_path / "one", *ov), 1e-5, "mixed")
    # plan=true plans what ran: the same plan.json, and the bytes each rank really held
    plan = json.loads((tmp_path / "mixed" / "plan.json").read_text())
    assert [u["mesh_dims"] for u in plan["units"]] == [["replicate", "shard"]] * 2 + [None]
    assert plan["bytes_per_rank"] == summary["measured_bytes_per_rank"]
    offline = plan_offline(compose(*ov))[0]
    check_estimate(offline.pop("estimate"), summary, "mixed")
    assert offline == plan


@pytest.mark.e2e
@pytest.mark.parametrize("plan", [False, True])
def test_mesh_dims_out_of_the_meshs_order_fail_before_any_rank(tmp_path: Path, plan: bool) -> None:
    """torch slices a sub-mesh only in the mesh's own order, and on a whole 2-D mesh would
    silently replicate over its first dim whatever the rule said: one line, exit 2, nothing run."""
    rev = ["+model=composite", "mesh=2x2", "sharding=hsdp", "sharding.rules.0.mesh_dims=[shard,replicate]"]
    r = cli(*rev, *(["plan=true"] if plan else []), cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert (
        "sharding.rules[0] (match='*').mesh_dims=['shard', 'replicate']: list the dims in the mesh's order" in lines[0]
    )
    assert not list(tmp_path.rglob("rank0.log")) and not list(tmp_path.rglob("plan.json"))
