"""The Llama 3 family model: its published shapes, its rotary scaling against transformers',
the blocks the sharding rules see, the meta-device build, and the 8B plan of a 64-rank mesh
made in seconds without materializing anything."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import compose, patience, read_metrics, train

from composerun.models import build_model
from composerun.models.init import why_not_on_meta
from composerun.models.llama import Llama, rope_frequencies
from composerun.parallel.rules import assign_units


def _meta(option: str) -> Llama:
    with torch.device("meta"):
        return build_model(compose(f"+model={option}").model)


@pytest.mark.parametrize(
    "option, params",
    # the published parameter counts (Hugging Face's model cards: 1.24B, 3.21B, 8.03B)
    [("llama3_1b", 1_235_814_400), ("llama3_3b", 3_212_749_824), ("llama3_8b", 8_030_261_248)],
)
def test_presets_have_the_published_shapes(option: str, params: int) -> None:
    model = _meta(option)
    assert sum(p.numel() for p in model.parameters()) == params
    assert why_not_on_meta(model) is None  # each rank makes only its shards, tied or not


def test_flops_per_token_is_six_n_plus_attention() -> None:
    """8B at 8192 tokens: 6 x (parameters less the input embedding) + 12 x layers x heads x
    head_dim x seq_len, torchtitan's count for the same model."""
    model = _meta("llama3_8b")
    n = 8_030_261_248 - 128256 * 4096
    assert model.flops_per_token(8192) == 6 * n + 12 * 32 * 32 * 128 * 8192


def test_llama3_rope_scaling_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = rope_frequencies(64, 500000.0, scaling)
    assert torch.equal(got, want)
    assert not torch.equal(got, rope_frequencies(64, 500000.0, None))  # the scaling changes something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_keeps_a_fused_kernel(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """On a GPU, SDPA's grouped-query path (enable_gqa) is flash (fp16/bf16 only) or math (which
    keeps the T x T scores): in fp32 the kv heads are repeated instead, so the memory-efficient
    kernel takes it; in bf16 enable_gqa stays (flash, kv heads not copied).  Either way the
    output is that of SDPA's own grouped-query path."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model(compose("+model=llama3_debug", "model.n_layers=1").model).to(dtype)  # 4 heads, 2 kv heads
    x = torch.randint(0, 2048, (2, 16))
    sdpa, calls = F.scaled_dot_product_attention, []

    def recording(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], v.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        got = model(x)
    assert calls == ([(4, 4, 4, False)] if dtype == torch.float32 else [(4, 2, 2, True)])
    monkeypatch.setattr("composerun.models.llama._kv_for_sdpa", lambda q, k, v, masked=False: (k, v))  # SDPA's own GQA
    with torch.no_grad():
        want = model(x)
    assert calls[-1] == (4, 2, 2, True)
    torch.testing.assert_close(got, want)


def test_per_block_policies_see_the_llama_layers() -> None:
    model = _meta("llama3_debug")
    for option in ("fsdp_blocks", "fsdp_blocks_ac", "hsdp_blocks"):
        units = assign_units(model, compose("+model=llama3_debug", f"sharding={option}").sharding.rules)
        blocks = sorted(f for f in units if f.startswith("layers."))
        every = 2 if option == "fsdp_blocks_ac" else 1
        assert blocks == [f"layers.{i}" for i in range(4)], option
        checkpointed = [f for f in blocks if "checkpoint" in units[f].apis]
        assert checkpointed == ([f"layers.{i}" for i in range(0, 4, every)] if option.endswith("_ac") else [])


def _plan_8b(sharding: str) -> tuple[dict, dict]:
    """plan=true's plan of llama3_8b on mesh 8x8 (without the estimate), made in this process as
    the command makes it: (plan.json's content, the facts of the planning).  (The command's own
    files and lines: tests/test_estimate.py's 8B command, tests/test_tokens.py's plan.)"""
    from composerun.parallel.planner import plan_offline

    cfg = compose("+model=llama3_8b", "mesh.shape=[8,8]", f"sharding={sharding}", "plan=true", "plan.estimate=false")
    return plan_offline(cfg)


def test_the_8b_plans_on_64_ranks_in_seconds() -> None:
    """plan=true on llama3_8b mesh=8x8: every block's shards and bytes per rank, nothing made.
    (Without the estimate: the 8B's is tests/test_estimate.py's.)"""
    plan, _ = _plan_8b("fsdp_blocks")
    assert "estimate" not in plan
    units = {u["fqn"]: u for u in plan["units"]}
    assert [f for f in units if f.startswith("layers.")] == [f"layers.{i}" for i in range(32)]
    assert all(units[f"layers.{i}"]["apis"] == ["fully_shard"] for i in range(32))
    total = sum(plan["bytes_per_rank"]["params"])
    assert total == 8_030_261_248 * 4  # fp32 parameters, each byte on exactly one rank of the 64
    assert max(plan["bytes_per_rank"]["params"]) <= math.ceil(total / 64) * 1.01


def test_the_8b_plans_fsdp_tp_on_64_ranks_in_seconds() -> None:
    """plan=true on llama3_8b mesh=8x8 sharding=fsdp_tp: FSDP over 8, tensor parallel over 8;
    every block's styles and 2-D shards, tensor parallelism's collectives, in seconds.  (Without
    the estimate: fsdp_tp's is tests/test_estimate.py's sweep's.)"""
    from composerun.parallel.plan import format_table

    plan, facts = _plan_8b("fsdp_tp")
    assert plan["mesh_dims"] == ["shard", "tp"]
    units = {u["fqn"]: u for u in plan["units"]}
    block = units["layers.0"]
    assert block["apis"] == ["parallelize", "fully_shard"]
    params = {p["name"]: p for p in block["params"]}
    q = params["layers.0.self_attn.q_proj.weight"]  # 4096 rows over tp 8, then over shard 8
    assert q["tp_shape"] == [512, 4096] and q["local_shape_per_rank"][0] == [64, 4096]
    total = sum(plan["bytes_per_rank"]["params"])
    norms = (32 * 2 + 1) * 4096  # sequence parallel's norms: whole on each of the 8 tp ranks (sharded over dp)
    assert total == (8_030_261_248 + 7 * norms) * 4  # every other byte on exactly one rank
    assert max(plan["bytes_per_rank"]["params"]) <= math.ceil(total / 64) * 1.01
    comm = plan["comm_per_step"]
    assert comm["tp_all_gather"] > 0 and comm["tp_reduce_scatter"] > 0 and comm["all_gather"] > 0
    assert facts["plan_s"] < patience(60)
    table = format_table(plan)  # the table plan=true prints
    assert "parallelize(11 styles)+fully_shard" in table and "parallelize(3 styles, loss parallel)+fully_shard" in table


@pytest.mark.distributed
@pytest.mark.parametrize("sharding", ["fsdp", "fsdp_blocks"])
def test_tied_embeddings_train_under_any_policy(tmp_path: Path, sharding: str) -> None:
    """Tied logits go through embed_tokens' forward: with `fsdp` (the embedding its own unit)
    the table is gathered for the output projection too, and the result is the 1-rank
    reference's (checkpoint.verify).  The model is made on the meta device, not whole."""
    run = tmp_path / "run"
    summary = train(
        run, "+model=llama3_debug", "mesh=2", f"sharding={sharding}", "model.kwargs.tie_embeddings=true",
        "model.n_layers=2", "model.seq_len=16", "train.steps=3", "optim=sgd", "checkpoint.verify=true",
    )  # fmt: skip
    assert summary["status"] == "ok" and summary["verify"]["ok"]
    assert json.loads((run / "summary.json").read_text())["verify"]["ok"]
    rows = read_metrics(run)
    assert rows[-1]["loss"] < rows[0]["loss"]
    log = (run / "rank0.log").read_text()
    assert "plan: llama3_debug on mesh 2" in log and "built whole" not in log  # (the log was written)


_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 300, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160}  # fmt: skip


@pytest.mark.parametrize(
    "config, line",
    [
        ([1, 2], "holds a JSON list, not a model's config"),
        ({**_CONFIG, "rope_scaling": "linear"}, "config.json's rope_scaling is 'linear', not an object of rope settings"),
        ({**_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         "llama3 rope settings lack a number for low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        ({**_CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' in config.json"),
        ({**_CONFIG, "hidden_size": "64"}, "config.json's hidden_size is '64', not an integer"),
        ({**_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "config.json is for MistralForCausalLM"),
        ({**_CONFIG, "mlp_bias": True}, "config.json has mlp_bias=True; composerun's Llama has mlp_bias=False"),
    ],
)  # fmt: skip
def test_a_config_json_composerun_cannot_load_is_one_line(tmp_path: Path, config: object, line: str) -> None:
    """A malformed or foreign config.json is a ConfigError (one line, exit 2), never a traceback."""
    from composerun.errors import ConfigError
    from composerun.models.hf import config_from_pretrained

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        config_from_pretrained(tmp_path)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_a_pretrained_path_is_expanded_once_for_every_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from composerun.models.hf import apply_pretrained

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(_CONFIG))
    monkeypatch.setenv("HOME", str(tmp_path))
    from conftest import compose_node

    cfg = compose_node("+model=llama3", "model.pretrained='~/hf'", validate=False)
    apply_pretrained(cfg)
    assert cfg.model.pretrained == str(tmp_path / "hf") and cfg.model.dim == 64 and cfg.model.kwargs.n_kv_heads == 2
