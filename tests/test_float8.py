"""`api: float8` (torchao) without a GPU: what can be checked on a CPU.

float8 training itself needs a CUDA GPU of compute capability 8.9 or more, so a run on a CPU
is refused before any rank starts (scripts/bad_inputs.py r16).  Here: the plan lists the
linears float8 converts and those whose shapes it cannot take; the conversion keeps each
linear's own initialization (a float8 run starts from a bf16 run's weights); and with
torchao's emulation of float8 products (a test-only switch) two gloo ranks train the
Llama with FSDP all-gathering float8 weights, close to the same run without float8.
Not tested here: real float8 matrix products, their speed (BENCHMARKS.md says why).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose, read_metrics

from composerun.config.schema import LaunchConfig, StartMethod
from composerun.launch.agent import start_ranks
from composerun.parallel.plan import format_table
from composerun.parallel.planner import plan_offline

pytest.importorskip("torchao")

LLAMA = ["+model=llama3_debug", "model.dim=64", "model.n_layers=2", "model.seq_len=16", "model.kwargs.ffn_dim=200"]
FLOAT8 = "sharding.rules=[{match: 'layers.*', api: float8}, {match: 'layers.*', api: fully_shard}, {match: '<root>', api: fully_shard}]"


def test_the_plan_lists_converted_and_skipped_linears() -> None:
    """q/k/v/o (64 and 32 wide) convert; the MLP's 200-wide linears cannot (not a multiple of 16)."""
    report, _ = plan_offline(compose(*LLAMA, "mesh=2", FLOAT8))
    block = next(u for u in report["units"] if u["fqn"] == "layers.0")
    assert block["apis"] == ["float8", "fully_shard"]
    f8 = block["api_options"]["float8"]
    assert f8["converted"] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    assert set(f8["skipped"]) == {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert "not a multiple of 16" in f8["skipped"]["mlp.up_proj"]
    assert f8["all_gather"] is True  # fully_shard holds the block: FSDP gathers float8 weights
    assert "float8 skips 6 linears: layers.0.mlp.gate_proj (64x200" in format_table(report)


@pytest.mark.distributed
def test_emulated_float8_trains_close_to_fp32(tmp_path: Path) -> None:
    """Also: FSDP all-gathers the converted weights in float8 (1 byte each), as planned."""
    from fixtures.matrix import count_collectives

    common = [*LLAMA, "model.kwargs.ffn_dim=128", "mesh=2", "train.steps=6", "metrics.progress=false"]
    jobs = [("float8", compose(*common, FLOAT8)), ("fp32", compose(*common, "sharding=fsdp_blocks"))]
    lcfg = LaunchConfig(start_method=StartMethod.forkserver)
    out = start_ranks(emulated, (count_collectives, jobs, str(tmp_path)), 2, tmp_path, lcfg)[0]
    (summary, comm), (_, fp32_comm) = out["float8"], out["fp32"]
    assert summary["status"] == "ok"
    f8 = [r["loss"] for r in read_metrics(tmp_path / "float8")]
    fp32 = [r["loss"] for r in read_metrics(tmp_path / "fp32")]
    assert f8 != fp32  # float8 really ran
    assert f8[0] == pytest.approx(fp32[0], rel=2e-2)  # the same initial weights: float8 rounding only
    assert f8[-1] < f8[0] and f8 == pytest.approx(fp32, rel=5e-2), (f8, fp32)
    plan = json.loads((tmp_path / "float8" / "plan.json").read_text())
    # (torchao's all-reduce of each weight's amax, a float per weight, is not in the plan)
    fsdp = {k: v for k, v in comm.items() if not k.startswith("tp_")}
    assert fsdp == {k: 6 * v for k, v in plan["comm_per_step"].items() if v}
    assert comm["all_gather"] < fp32_comm["all_gather"]


def emulated(entry, jobs: list, root: str) -> dict:
    from composerun.parallel import float8

    float8.EMULATE = True
    return entry(jobs, root)


def test_a_converted_linear_keeps_its_initialization(mesh) -> None:
    """Float8Linear replaces composerun's Linear, whose N(0, std) init it keeps (not Kaiming)."""
    from composerun.models import build_model
    from composerun.models.init import build, materialize
    from composerun.parallel.apply import apply_policy

    weights = {}
    for name, rules in (("float8", [FLOAT8]), ("plain", ["sharding=fsdp_blocks"])):
        cfg = compose(*LLAMA, *rules)
        model, on_meta = build(cfg.model, cfg.train.seed, torch.device("cpu"))
        apply_policy(model, cfg.sharding, mesh)
        assert on_meta
        materialize(model, torch.device("cpu"), cfg.train.seed, lambda c=cfg: build_model(c.model))
        weights[name] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if name == "float8":
            assert type(model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"
    assert list(weights["float8"]) == list(weights["plain"])
    for k in weights["plain"]:
        assert torch.equal(weights["float8"][k].float(), weights["plain"][k].float()), k
