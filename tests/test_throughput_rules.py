"""The throughput rules on real gloo ranks: tensor parallelism, compile, selective activation
checkpointing, against one plain rank.

- TP cells: the Llama (a small one, of one block) and the transformer under `tp` (mesh 2) and
  `fsdp_tp` (2x2), and the Llama under `hsdp_tp` (2x2x2), end within 1e-5 of the same model
  trained on one rank with no distributed API (fp32, CPU gloo) and log its grad norm at every
  step within 2e-5 (a norm that counted the norm weights' gradients once per `tp` rank, 1e-4 to 1e-2 off, moved
  AdamW's weights by less than 1e-5); each rank holds what the plan says, the bytes of every
  collective (FSDP's and tensor parallelism's) are the plan's, and plan=true (the fake process
  group) writes the very same plan.json.
- Compile cells: the Llama compiled per block (inductor's C++ backend) ends within 1e-5 of the
  same policy in eager mode, its graphs counted (summary.json's compiled_graphs); full and
  selective checkpointing inside the compiled blocks end within 1e-5 of no checkpointing; so
  does the compiler's memory budget (mode budget, 0.3).  These three compile through
  AOTAutograd's decompositions and min-cut partitioner, which decide what the backward saves and
  recomputes, and run its graphs as aten ops (backend aot_eager_decomp_partition, graphs counted
  too): the claim is about what is recomputed, and inductor's C++ kernels are checked by the
  cell without AC here and by bf16's selective AC below.  A compiled cell's plan, estimate and
  measured step are those of its policy in eager mode (compile changes kernels, not what is
  held; the measured step runs eagerly), so the compiled AC cells check eager AC's plan too.
- The bf16 tier (`sharding.param_dtype=bfloat16`, gradients reduced in fp32): full and
  selective AC compiled (the cast of FSDP's pre-forward kept out of the recomputation; selective
  AC with inductor, the pair that once crashed at step 1; full AC through the partitioner, as
  its fp32 twin), eager without AC, and fsdp_tp, trains; each cell logs the losses and grad
  norms of its fp32 twin within a bf16 tolerance at every step; the compiled AC cells stay close
  to bf16 without AC; the plan's bytes and estimate hold.
- Elsewhere: eager full and selective AC recompute the same kernels as no AC, gradients bit for
  bit in fp32 and bf16 (tests/test_activation_checkpointing.py, the same blocks and rules under
  fully_shard: equal gradients from equal weights make equal steps); full AC on 2 and 2x2 ranks
  against one rank, every model (tests/test_policies.py, fsdp_ac and fsdp_blocks_ac).  Mode
  budget sets no checkpoint around the block (the compiler's partitioner picks what to
  recompute): in bf16 it compiles what bf16's other compiled cells compile, and composerun's
  part, the budget handed to the compiler, is the same in fp32.
Each mesh (and naming of its dims) is one launch of ranks that trains its cells in turn
(tests/fixtures/matrix.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_close_weights, check_plan, compose, final_weights, read_metrics, train
from fixtures.matrix import count_collectives

from composerun.config import world_size_of
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.launch.agent import start_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP loads with no group
]

STEPS = 3
ATOL = 1e-5
# one block: every rule below matches `layers.*`, and each block is one more copy of the same
# kernels (and of the same compiled graph) to run, to trace on fake tensors and to check
LLAMA = ["+model=llama3_debug", "model.dim=64", "model.n_layers=1", "model.seq_len=16", "model.kwargs.ffn_dim=128"]
MODELS = {
    "llama": LLAMA,
    "transformer": ["+model=transformer", "model.dim=32", "model.n_layers=2", "model.seq_len=8"],
}
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "metrics.progress=false", "data.batch_size=4"]
SELECTIVE = "{match: 'layers.*', api: checkpoint, mode: selective}"
COMPILE = "{match: 'layers.*', api: compile}"
# the same compiler up to the kernels: dynamo's graph, AOTAutograd's decompositions and min-cut
# partitioner (where checkpointing and the memory budget are decided), run as aten ops, without
# inductor's code generation (a C++ build per graph and rank, the launch's cost on a cold cache)
PARTITION = "{match: 'layers.*', api: compile, backend: aot_eager_decomp_partition}"
BUDGET = "{match: 'layers.*', api: checkpoint, mode: budget, memory_budget: 0.3}"
SHARD = "{match: 'layers.*', api: fully_shard}, {match: '<root>', api: fully_shard}"
FULL = "{match: 'layers.*', api: checkpoint, mode: full}"
BF16 = "sharding.param_dtype=bfloat16"
# the compile launch's cells in fp32, and in BF16_CELLS those in bf16 (name prefixed bf16-, the
# fp32 cell of the same name its twin): inductor compiles the blocks without AC in fp32 and with
# selective AC in bf16 (the pair that crashed at step 1), the AC cells in fp32 and full AC in bf16
# go through the partitioner alone (what they check is what it recomputes)
PRECISION_CELLS = {
    "eager": ["sharding=fsdp_blocks"],
    "compiled": ["sharding=fsdp_blocks_compile"],
    "compiled-full": [f"sharding.rules=[{FULL}, {PARTITION}, {SHARD}]"],
    "compiled-selective": [f"sharding.rules=[{SELECTIVE}, {PARTITION}, {SHARD}]"],
    "compiled-budget": [f"sharding.rules=[{BUDGET}, {PARTITION}, {SHARD}]"],
}
BF16_CELLS = {
    "eager": PRECISION_CELLS["eager"],
    "compiled-full": PRECISION_CELLS["compiled-full"],
    "compiled-selective": [f"sharding.rules=[{SELECTIVE}, {COMPILE}, {SHARD}]"],
}
# launch -> {cell: overrides}: each launch is one mesh with one naming of its dims
LAUNCHES: dict[str, dict[str, list[str]]] = {
    "tp": {f"{m}-tp": [*MODELS[m], "mesh=2", "sharding=tp"] for m in MODELS},
    "fsdp_tp": {
        **{f"{m}-fsdp_tp": [*MODELS[m], "mesh=2x2", "sharding=fsdp_tp"] for m in MODELS},
        "bf16-llama-fsdp_tp": [*MODELS["llama"], "mesh=2x2", "sharding=fsdp_tp", BF16],
    },
    # the Llama alone on the 8 ranks: the transformer's tensor-parallel plan under FSDP is fsdp_tp's
    "hsdp_tp": {"llama-hsdp_tp": [*MODELS["llama"], "mesh=2x2x2", "sharding=hsdp_tp"]},
    "compile": {
        **{cell: [*MODELS["llama"], "mesh=2", *ov] for cell, ov in PRECISION_CELLS.items()},
        # (compile without AC in bf16: the bf16 compiled AC cells compile the same blocks in bf16)
        **{f"bf16-{cell}": [*MODELS["llama"], "mesh=2", *ov, BF16] for cell, ov in BF16_CELLS.items()},
    },
}
# a bf16 cell against its fp32 twin, step by step (the same fp32 master weights, computed in bf16):
# measured here at most 3e-5 apart in loss and 1e-3 in grad norm, over every cell
LOSS_RTOL, NORM_RTOL = 2e-4, 5e-3


def _model(cell: str) -> str:
    return "transformer" if cell.startswith("transformer") else "llama"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model trained on one rank, with no distributed API."""
    root = tmp_path_factory.mktemp("reference")
    for m in MODELS:
        train(root / m, *MODELS[m], *COMMON, "mesh=1", "sharding=none")
    return {m: root / m for m in MODELS}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory):
    """launch -> {cell: (run dir, rank 0's summary, bytes of every collective, overrides)}, on first use."""
    done: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            cells = {cell: [*ov, *COMMON] for cell, ov in LAUNCHES[name].items()}
            jobs = [(cell, compose(*ov)) for cell, ov in cells.items()]
            world = world_size_of(jobs[0][1].mesh.shape)
            lcfg = LaunchConfig(start_method=StartMethod.forkserver)
            out = start_ranks(count_collectives, (jobs, str(root)), world, root, lcfg)[0]
            done[name] = {cell: (root / cell, *out[cell], cells[cell]) for cell in cells}
        return done[name]

    return get


@pytest.mark.parametrize("launch", ["tp", "fsdp_tp", "hsdp_tp"])
def test_tensor_parallel_cells_match_one_rank(launches, reference, launch: str) -> None:
    failures = []
    for cell, (run, summary, comm, ov) in launches(launch).items():
        if cell.startswith("bf16-"):
            continue  # test_bf16_cells_follow_fp32
        try:
            assert summary["status"] == "ok" and summary["steps"] == STEPS
            assert all(math.isfinite(r["loss"]) for r in read_metrics(run))
            assert_close_weights(final_weights(run, *ov), final_weights(reference[_model(cell)], *ov), ATOL, cell)
            check_plan(run, summary, comm, ov, STEPS)
            assert any(k.startswith("tp_") and v for k, v in comm.items()), f"{cell}: no tensor-parallel collective"
            norms = [r["grad_norm"] for r in read_metrics(run)]
            want = [r["grad_norm"] for r in read_metrics(reference[_model(cell)])]
            assert len(want) == STEPS and norms == pytest.approx(want, rel=2e-5), f"grad_norm {norms}, one rank {want}"
        except AssertionError as e:
            failures.append(f"{cell}: {e}")
    assert not failures, "\n".join(failures)


def test_tp_plan_lists_styles_and_tp_shards(launches) -> None:
    """plan.json names each block's styles and holds the tensor-parallel shard of each weight:
    q_proj split by rows over tp (then by FSDP), o_proj by columns."""
    run, *_ = launches("fsdp_tp")["llama-fsdp_tp"]
    plan = json.loads((run / "plan.json").read_text())
    block = next(u for u in plan["units"] if u["fqn"] == "layers.0")
    assert block["apis"] == ["parallelize", "fully_shard"]
    styles = block["api_options"]["parallelize"]["styles"]
    assert styles["self_attn.q_proj"] == {"style": "colwise"}
    assert styles["self_attn.o_proj"] == {"style": "rowwise", "output_layouts": "shard(1)"}
    params = {p["name"]: p for p in block["params"]}
    assert params["layers.0.self_attn.q_proj.weight"]["tp_shape"] == [32, 64]  # 64 rows over tp=2
    assert params["layers.0.self_attn.o_proj.weight"]["tp_shape"] == [64, 32]  # 64 columns over tp=2
    # then FSDP halves dim 0 of what tensor parallelism left: 16 rows of q, 32 of o
    assert [s for s in params["layers.0.self_attn.q_proj.weight"]["local_shape_per_rank"]] == [[16, 64]] * 4
    assert [s for s in params["layers.0.self_attn.o_proj.weight"]["local_shape_per_rank"]] == [[32, 32]] * 4
    root = next(u for u in plan["units"] if u["fqn"] == "<root>")
    assert root["api_options"]["parallelize"]["loss_parallel"] is True


def test_compile_and_selective_checkpointing_match_eager(launches) -> None:
    cells = launches("compile")
    eager = final_weights(cells["eager"][0], *cells["eager"][3])
    for cell in [c for c in PRECISION_CELLS if c != "eager"]:
        run, summary, comm, ov = cells[cell]
        assert summary["status"] == "ok" and summary["steps"] == STEPS, cell
        assert_close_weights(final_weights(run, *ov), eager, ATOL, cell)
        check_plan(run, summary, comm, ov, STEPS)
        # the blocks ran compiled: graphs made in this cell (its launch resets the compiler's caches)
        assert (summary["compiled_graphs"] > 0) == cell.startswith("compiled"), (cell, summary["compiled_graphs"])
    for cell, backend in (
        ("compiled-selective", "aot_eager_decomp_partition"),
        ("bf16-compiled-selective", "inductor"),
    ):
        plan = json.loads((cells[cell][0] / "plan.json").read_text())
        block = next(u for u in plan["units"] if u["fqn"] == "layers.0")
        assert block["apis"] == ["checkpoint", "compile", "fully_shard"]  # the order they are applied in
        assert block["api_options"]["checkpoint"]["mode"] == "selective"
        assert "aten.mm" in block["api_options"]["checkpoint"]["save_ops"]
        assert block["api_options"]["compile"] == {
            "mode": "default",
            "fullgraph": False,
            "dynamic": None,
            "backend": backend,
        }


def _curve(run: Path, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run)]


@pytest.mark.parametrize("launch", ["compile", "fsdp_tp"])
def test_bf16_cells_follow_fp32(launches, launch: str) -> None:
    """Every bf16 cell trains and stays with its fp32 twin at every step; compiled AC in bf16
    stays close to bf16 without AC."""
    cells = launches(launch)
    failures = []
    for cell in [c for c in cells if c.startswith("bf16-")]:
        run, summary, comm, ov = cells[cell]
        twin = cells[cell.removeprefix("bf16-")][0]
        try:
            assert summary["status"] == "ok" and summary["steps"] == STEPS
            for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
                got, want = _curve(run, key), _curve(twin, key)
                assert len(got) == STEPS and got == pytest.approx(want, rel=rtol), f"{key} {got}, fp32 {want}"
            check_plan(run, summary, comm, ov, STEPS)
            if launch == "compile" and cell != "bf16-eager":
                base = cells["bf16-eager"]
                assert summary["compiled_graphs"] > 0  # other kernels' bf16 rounding: the curves stay close
                for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
                    assert _curve(run, key) == pytest.approx(_curve(base[0], key), rel=rtol), key
            elif launch == "compile":
                assert summary["compiled_graphs"] == 0
        except AssertionError as e:
            failures.append(f"{cell}: {e}")
    assert not failures, "\n".join(failures)
