"""What tiny CPU runs used to hide and large GPU runs would show (issue 19): the memory of
gradient accumulation, a non-finite gradient behind a finite loss, building the whole model
on every rank, and data parallelism taken to be the whole world."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose, read_metrics, train
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from composerun.errors import RunFailed

pytestmark = pytest.mark.distributed


def test_grad_accumulation_holds_only_gradient_shards(tmp_path: Path) -> None:
    """grad_accum=4 on 2 ranks: between micro-batches each rank holds its shard of the
    gradients (reduce-scattered every micro-batch), not the whole model's; the opt-in that
    keeps whole gradients holds the whole model's, and the plan says so.  (The figures of
    scripts/bench_accum_memory.py, its ranks forked from this session's fork server.)"""
    from bench_accum_memory import measure

    result = measure(16, "2", 4, 2, tmp_path, start_method="forkserver")
    for f in result["default"]:
        assert f["held"] == f["shard"] == f["plan_grads"] and 0 < f["held"] < f["whole"], f
    for f in result["accumulate_unsharded"]:
        assert f["held"] == f["whole"] == f["plan_grads"], f


def test_a_non_finite_gradient_stops_the_run_before_its_checkpoint(tmp_path: Path) -> None:
    """A finite loss with an infinite gradient (at step 3, a checkpoint due every step) on 2
    ranks: one line naming the gradient norm and the step; `latest` stays at step 2, whose
    weights are finite; no step-3 checkpoint is published.  (That a rank's failure is that one
    line on the console, exit 1: scripts/bad_inputs.py k07.)"""
    run = tmp_path / "run"
    with pytest.raises(RunFailed) as e:
        train(
            run, "+model=unit", "model._target_=fixtures.scale.InfGradAt", "model.dim=8", "mesh=2",
            "checkpoint.every=1", "checkpoint.export=none",
        )  # fmt: skip
    line = str(e.value)
    assert "\n" not in line.strip(), line
    assert "gradient norm is inf (the loss" in line or "gradient norm is nan (the loss" in line, line
    assert "at step 3: stopped, nothing after step 2 is saved" in line, line
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").resolve().name == "step-00000002"
    assert not list(ckpts.glob("step-00000003*"))
    dcp_to_torch_save(str(ckpts / "latest"), str(tmp_path / "flat.pt"))
    sd = torch.load(tmp_path / "flat.pt", weights_only=True)["model"]
    assert sd and all(torch.isfinite(t).all() for t in sd.values())


def test_a_non_finite_loss_is_named_as_the_loss(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(RunFailed) as e:
        train(run, "+model=unit", "model.dim=8", "optim=sgd", "optim.lr=1e5", "optim.grad_clip=0")
    line = str(e.value)
    assert "\n" not in line.strip() and "NonFiniteError: loss is" in line and "lower optim.lr" in line, line
    rows = read_metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and f"at step {len(rows) + 1}" in summary["error"]


def test_ranks_build_the_model_on_the_meta_device(tmp_path: Path) -> None:
    """A model that refuses to be built in memory trains: every rank builds it on the meta
    device and makes only its shards; the initial weights are the same on meshes 1 and 2."""
    ov = ["+model=unit", "model._target_=fixtures.scale.BuiltOnMeta", "model.dim=8", "checkpoint.export=safetensors"]
    ov += ["train.steps=2", "optim.lr=1e-9"]  # weights that stay (all but) the initial ones
    weights = {}
    for mesh in ("1", "2"):
        assert train(tmp_path / mesh, *ov, f"mesh={mesh}")["status"] == "ok"
        weights[mesh] = load_file(tmp_path / mesh / "export" / "model.safetensors")
    assert weights["1"].keys() == weights["2"].keys()
    for k in weights["1"]:
        torch.testing.assert_close(weights["1"][k], weights["2"][k], atol=1e-7, rtol=0)


def test_a_model_without_reset_parameters_is_built_whole_and_says_so(tmp_path: Path) -> None:
    for mesh in ("1", "2"):
        summary = train(
            tmp_path / mesh, "+model=unit", "model._target_=fixtures.scale.NoReset", "model.dim=8", f"mesh={mesh}",
            "train.steps=3", "checkpoint=none",
        )  # fmt: skip
        assert summary["status"] == "ok"
    log = (tmp_path / "2" / "rank0.log").read_text()
    assert (
        "built whole on every rank (module '' has no reset_parameters())" in log or "has no reset_parameters()" in log
    )
    losses = [[r["loss"] for r in read_metrics(tmp_path / m)] for m in ("1", "2")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_tensor_parallel_peers_share_samples(tmp_path: Path) -> None:
    """A mesh with a `tp` dim the policy leaves alone: its two ranks are one data-parallel
    replica (the same samples, the loss counted once), so a 2x2 mesh with FSDP over `shard`
    trains exactly as one rank does: same losses, grad norms and weights."""
    common = ["+model=composite", "model.dim=16", "train.steps=4", "data.batch_size=4"]
    common += ["optim.lr=0.05", "checkpoint=none"]
    train(tmp_path / "ref", *common, "mesh=1", "sharding=none")
    summary = train(
        tmp_path / "tp", *common, "mesh=2x2", "mesh.dim_names=[shard,tp]", "sharding=fsdp",
        "sharding.rules.0.mesh_dims=[shard]",
    )  # fmt: skip
    assert summary["status"] == "ok"
    ref, tp = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "tp")
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in ref], abs=1e-6)
    assert [r["grad_norm"] for r in tp] == pytest.approx([r["grad_norm"] for r in ref], abs=1e-6)


def test_a_preemption_is_agreed_within_ten_steps_whatever_log_every(mesh, tmp_path: Path) -> None:
    """The host reads the step's values only on logged steps, and at least every 10th: a
    SIGTERM during step 3 of a run logging every 50 steps stops it after step 10, with its
    checkpoint."""
    from composerun import stopping
    from composerun.errors import Preempted
    from composerun.train.run import train as train_on

    cfg = compose(
        "+model=unit", "model._target_=fixtures.scale.SignalsAt", "model.dim=8", "train.steps=40",
        "train.log_every=50", "metrics.progress=false",
    )  # fmt: skip
    try:
        with stopping.recording(), pytest.raises(Preempted):
            train_on(cfg, tmp_path / "run", mesh, torch.device("cpu"))
    finally:
        stopping._received.clear()  # this process's record: later tests launch ranks from it
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["preempted_at_step"] == 10, summary
    assert (tmp_path / "run" / "checkpoints" / "latest").resolve().name == "step-00000010"
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 10]


def test_tied_weights_stay_tied(caplog: pytest.LogCaptureFixture) -> None:
    """A parameter two modules share would become two on the meta device (`to_empty` gives
    each module its own): such a model is built whole, and stays tied."""
    from composerun.models.init import build

    cfg = compose("+model=transformer", "model._target_=fixtures.scale.Tied", "model.dim=8", "mesh=1")
    with caplog.at_level("INFO", logger="composerun"):
        model, on_meta = build(cfg.model, 0, torch.device("cpu"))
    assert not on_meta and model.head.weight is model.emb.weight
    assert "tied weights" in caplog.text
