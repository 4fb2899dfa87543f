"""Tensor parallelism of any Hugging Face causal LM (`+model=hf` under sharding=tp and fsdp_tp),
from transformers' own plan for the model (models/hf_tp.py), against transformers itself.

Three families cover the plan's styles: Llama (colwise / rowwise, the embedding split by
vocabulary, the logits left split for the loss), Qwen3 (per-head q_norm / k_norm whose gradients
are summed over tp; tied embeddings, which stay whole) and Phi-3 (packed qkv_proj and gate_up_proj:
their output gathered, the next projection's input split).  Their tiny random directories are
tests/test_hf_any.py's.  On mesh 2 (tp) and 2x2 (fsdp_tp) composerun's logits of the same
tokens are transformers' within 1e-5 (fp32), and so is every gradient of their loss; on 2x2 each family trains three steps, whose losses
are those of a plain transformers + torch loop (test_hf_any's oracle) within 1e-4 of the trained
change, and its export is the oracle's trained model in transformers.  On both meshes data=sft's
packed rows keep their documents apart: each document's per-token losses are transformers' on the
document alone, the token-weighted loss (vocabulary-parallel where the plan splits the logits) is
transformers' over the documents, and changing one document's tokens changes no other token's
loss.  The issue's command, as a
user types it, trains a Qwen3 directory on the shipped tokens; plan=true shows its plan; what
composerun cannot split is refused in one line.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cli, read_metrics
from fixtures.chat import random_docs, write_chat_shards
from fixtures.hf_tp import logits_grads_then_train
from test_hf_any import COMMON, SEQ, STEPS, TRAIN, config, make, oracle_run

from composerun.config import world_size_of
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.data import SFTData
from composerun.errors import ConfigError
from composerun.launch.agent import start_ranks

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen3", "phi3"]
MESHES = {"2": "tp", "2x2": "fsdp_tp"}
# (no resume here: no checkpoints; no test here reads a run's peak memory: no step under the tracker)
FIT = [t for t in TRAIN if not t.startswith("checkpoint.every")] + ["metrics.track_memory=false"]


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("families")
    return {f: (root / f, make(root / f, f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(COMMON["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(5))


ROWS = 4  # packed rows of the probe: samples 0..3 of data=sft's epoch 0
SFT = ["data=sft", f"data.seq_len={SEQ}", "data.val_fraction=0"]


@pytest.fixture(scope="module")
def packed(families: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Chat shards of documents of uneven lengths (3 to 9 tokens, several a row) in folder a, and
    in folder b the same but for the victim (the first document of a row that packs two or more),
    whose tokens differ; each row's documents in order."""
    root = tmp_path_factory.mktemp("sft")
    docs = random_docs(seed=17, count=16, lo=3, hi=10, vocab=COMMON["vocab_size"])
    write_chat_shards(root / "a", docs, per_shard=8)
    cfg = config(families["llama"][0], *SFT, f"data.path={root / 'a'}")
    data = SFTData(cfg.model, seed=cfg.data.seed, path=str(root / "a"), seq_len=SEQ, val_fraction=0.0)
    rows = [data.epoch(0).members(r) for r in range(ROWS)]
    victim = next(m[0] for m in rows if len(m) >= 2)
    changed = [(t % (COMMON["vocab_size"] - 1) + 1 if d == victim else t, m) for d, (t, m) in enumerate(docs)]
    write_chat_shards(root / "b", changed, per_shard=8)
    return {"root": root, "docs": docs, "rows": rows, "victim": victim}


@pytest.fixture(scope="module")
def on_meshes(
    families: dict, tokens: torch.Tensor, packed: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Per mesh, every rank's logits per family (one launch per mesh) and its packed rows of
    data=sft (folders a and b); 2x2 also trains each."""
    out = {}
    sft = [*SFT, f"data.path={packed['root'] / 'a'}"]
    for mesh, policy in MESHES.items():
        root = tmp_path_factory.mktemp(f"mesh{mesh}")
        over = [f"mesh={mesh}", f"sharding={policy}"]
        jobs = [(f, config(d, *over, *sft), config(d, *over, *FIT) if mesh == "2x2" else None)
                for f, (d, _) in families.items()]  # fmt: skip
        world = world_size_of(jobs[0][1].mesh.shape)
        probe = (str(packed["root"] / "b"), ROWS)
        ranks = start_ranks(logits_grads_then_train, (jobs, tokens, str(root), probe), world, root,
                            LaunchConfig(start_method=StartMethod.forkserver))  # fmt: skip
        out[mesh] = {"ranks": ranks, "root": root, "cfg": {f: t for f, _, t in jobs}}
    return out


_ORACLES: dict[str, tuple[list[float], Any]] = {}


def oracle(family: str, directory: Path, cfg: Any) -> tuple[list[float], Any]:
    if family not in _ORACLES:
        _ORACLES[family] = oracle_run(directory, cfg)[:2]  # (losses, trained model)
    return _ORACLES[family]


_REFS: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}


def reference(family: str, model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits of tokens[:, :-1] and the gradient of their next-token loss."""
    if family not in _REFS:
        model = copy.deepcopy(model)
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        _REFS[family] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    return _REFS[family]


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_transformers(on_meshes: dict, families: dict, tokens: torch.Tensor, mesh: str, family: str) -> None:
    ref, _ = reference(family, families[family][1], tokens)
    for rank, got in on_meshes[mesh]["ranks"].items():
        diff = (got[family]["logits"] - ref).abs().max().item()
        assert diff <= 1e-5, f"{family} on mesh {mesh} ({MESHES[mesh]}), rank {rank}: logits differ by {diff:.3g}"


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_are_transformers(
    on_meshes: dict, families: dict, tokens: torch.Tensor, mesh: str, family: str
) -> None:
    """Every parameter's gradient, as the step hands it to the optimizer, is transformers' own
    within 1e-4 of its largest entry: among them the per-head norms' (Qwen3's q_norm, k_norm),
    which each tp rank computes from its own heads alone and which must be summed over tp."""
    _, want = reference(family, families[family][1], tokens)
    for rank, got in on_meshes[mesh]["ranks"].items():
        grads = got[family]["grads"]
        assert set(grads) == set(want), f"{family}: {sorted(set(grads) ^ set(want))}"
        for name, g in grads.items():
            diff, scale = (g - want[name]).abs().max().item(), want[name].abs().max().item()
            assert diff <= 1e-4 * scale, (
                f"{family} on mesh {mesh}, rank {rank}: {name}'s gradient differs by {diff:.3g} (largest {scale:.3g})"
            )


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_training_on_fsdp_tp_is_a_plain_transformers_loop(on_meshes: dict, families: dict, family: str) -> None:
    run = on_meshes["2x2"]
    losses = [r["loss"] for r in read_metrics(run["root"] / f"{family}-train") if "loss" in r]
    ref, _ = oracle(family, families[family][0], run["cfg"][family])
    assert len(losses) == STEPS
    change = abs(ref[-1] - ref[0])
    assert change > 1e-3, f"{family}: the oracle's loss barely moved ({ref})"
    for got, want in zip(losses, ref, strict=True):
        assert abs(got - want) <= 1e-4 * change, f"{family}: losses {losses} != oracle {ref}"


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fsdp_tp_export_is_the_trained_model(
    on_meshes: dict, families: dict, tokens: torch.Tensor, family: str
) -> None:
    run = on_meshes["2x2"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        run["root"] / f"{family}-train" / "export" / "hf", dtype=torch.float32
    ).eval()
    _, trained = oracle(family, families[family][0], run["cfg"][family])
    with torch.no_grad():
        diff = (exported(input_ids=tokens).logits - trained(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, f"{family}: the export's logits differ from the trained oracle's by {diff:.3g}"


def alone(model: Any, docs: list, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' per-token losses of document d run alone (its n-1 next tokens), and whether
    each counts (its loss mask)."""
    tok = torch.from_numpy(docs[d][0].astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids=tok[None, :-1]).logits[0]
    return F.cross_entropy(logits, tok[1:], reduction="none"), torch.from_numpy(docs[d][1][1:].astype(bool))


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_are_transformers_on_each_alone(
    on_meshes: dict, families: dict, packed: dict, mesh: str, family: str
) -> None:
    """data=sft's packed rows through +model=hf under tp (mesh 2) and fsdp_tp (2x2): each
    document's per-token losses are transformers' on that document alone, the step's loss is
    transformers' token-weighted loss of the documents (ignore_index: the targets their masks
    train), and in the rows of folder b, whose victim document's tokens differ, every token's
    loss but the victim's (and that of the token before it, whose target it is) is unchanged."""
    docs, rows, victim = packed["docs"], packed["rows"], packed["victim"]
    hf = families[family][1]
    total, count = 0.0, 0
    want = {}
    for d in {d for m in rows for d in m}:
        want[d] = alone(hf, docs, d)
        total, count = total + want[d][0][want[d][1]].sum().item(), count + int(want[d][1].sum())
    nxt = torch.zeros(ROWS, SEQ + 1, dtype=torch.long)  # each row's tokens (padding 0): the next tokens
    outside = torch.ones(ROWS, SEQ, dtype=torch.bool)  # not the victim's inputs nor its first target
    for r, members in enumerate(rows):
        row = np.concatenate([docs[d][0] for d in members]).astype(np.int64)
        nxt[r, : len(row)] = torch.from_numpy(row)
        at = 0
        for d in members:
            if d == victim:
                outside[r, max(at - 1, 0) : at + len(docs[d][0])] = False
            at += len(docs[d][0])
    for rank, got in on_meshes[mesh]["ranks"].items():
        (a, b), where = got[family]["packed"], f"{family} on mesh {mesh} ({MESHES[mesh]}), rank {rank}"
        per_token = [F.cross_entropy(p["logits"].flatten(0, 1), nxt[:, 1:].flatten(), reduction="none").view(ROWS, SEQ)
                     for p in (a, b)]  # fmt: skip
        for r, members in enumerate(rows):
            at = 0
            for d in members:
                n = len(docs[d][0])
                diff = (per_token[0][r, at : at + n - 1] - want[d][0]).abs().max().item()
                assert diff <= 1e-5, f"{where}: row {r}'s document {d} differs from itself alone by {diff:.3g}"
                at += n
        assert a["loss"] == pytest.approx(total / count, abs=1e-5), where
        moved = (per_token[0] - per_token[1]).abs()
        assert moved[outside].max().item() <= 1e-6, f"{where}: changing document {victim} moved other tokens' losses"
        assert moved[~outside].max().item() > 1e-3, f"{where}: the changed document's losses did not change"


# --- the issue's command, as a user types it ------------------------------------------------------

ISSUE = ("mesh=2x2", "sharding=fsdp_tp", "data=tokens")


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Qwen3 directory with tied embeddings (as Qwen3-0.6B's) and the shipped tokens'
    vocabulary, and a Qwen3-MoE one; the commands that start no rank (plan=true of the first,
    the second under fsdp_tp) run one after another in one process (scripts/one_process.py),
    each through the function the `composerun` script calls."""
    from one_process import run_commands

    root = tmp_path_factory.mktemp("typed")
    qwen3, moe = root / "qwen3", root / "moe"
    cfg = transformers.Qwen3Config(**{**COMMON, "vocab_size": 2048}, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(qwen3)
    moe_cfg = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    )
    transformers.AutoModelForCausalLM.from_config(moe_cfg).save_pretrained(moe)
    for cwd in ("plan_cwd", "moe_cwd"):
        (root / cwd).mkdir()
    planned, refused = run_commands([
        (["+model=hf", f"model.pretrained={qwen3}", *ISSUE, "plan=true", "hydra.run.dir=planned"], root / "plan_cwd"),
        (["+model=hf", f"model.pretrained={moe}", "mesh=2x2", "sharding=fsdp_tp"], root / "moe_cwd"),
    ])  # fmt: skip
    return {"qwen3": qwen3, "planned": (planned, root / "plan_cwd" / "planned"), "moe": (refused, root / "moe_cwd")}


def test_the_issues_command_trains_a_qwen3_directory(typed: dict, tmp_path: Path) -> None:
    """`composerun +model=hf model.pretrained=DIR mesh=2x2 sharding=fsdp_tp data=tokens` on a
    Qwen3 directory with tied embeddings (as Qwen3-0.6B's) and the shipped tokens' vocabulary:
    its loss falls, its export loads in transformers with a lower loss than the directory's on
    the first batch; plan=true shows the plan, tied embeddings whole."""
    from composerun.data import build_data

    directory = typed["qwen3"]
    args = ("+model=hf", f"model.pretrained={directory}", *ISSUE)
    r = cli(*args, "train.steps=6", "train.log_every=1", "optim.lr=1e-2", "optim.warmup_steps=1",
            "checkpoint.export=hf", "metrics.track_memory=false", "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses

    x, y = build_data(config(directory, "data=tokens")).batch(range(8))
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        after = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "run" / "export" / "hf", dtype=torch.float32
        )
        loss = {m: F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
                for m, model in (("before", before), ("after", after))}  # fmt: skip
    assert loss["after"] < loss["before"] - 0.1, (loss, losses)

    r, planned = typed["planned"]
    assert r.returncode == 0, r.stderr[-3000:]
    units = {u["fqn"]: u for u in json.loads((planned / "plan.json").read_text())["units"]}
    layer = units["model.layers.0"]["api_options"]["parallelize"]
    assert layer["styles"]["self_attn.q_norm"] == {"style": "sequence", "sequence_dim": -2, "use_local_output": True}
    assert layer["styles"]["self_attn.q_proj"] == {"style": "colwise"}
    assert "tensor parallelism leaves model.embed_tokens, lm_head whole: tied embeddings" in r.stdout + r.stderr


# --- what composerun cannot split: one line, before any rank starts --------------------------------


def _refusal(directory: Path, mesh: str, policy: str) -> str:
    from composerun.launch.preflight import meta_model
    from composerun.parallel.rules import assign_units, effective_rules

    cfg = config(directory, f"mesh={mesh}", f"sharding={policy}")
    sizes = dict(zip(cfg.sharding.mesh_dim_names, cfg.mesh.shape, strict=True))
    with pytest.raises(ConfigError) as e:
        assign_units(meta_model(cfg), effective_rules(cfg.sharding), sizes)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_mixture_of_experts_plan_is_refused_on_the_command_line(typed: dict) -> None:
    r, cwd = typed["moe"]
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("composerun: error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "model.layers.0.mlp.experts has transformers' tensor-parallel style 'moe_tp_experts'" in errors[0]
    assert not (cwd / "outputs").exists() or not list((cwd / "outputs").rglob("rank0.log"))  # no rank ran


def test_a_model_without_a_plan_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "stablelm"
    transformers.AutoModelForCausalLM.from_config(transformers.StableLmConfig(**COMMON)).save_pretrained(directory)
    assert "StableLmForCausalLM has no tensor-parallel plan in transformers" in _refusal(directory, "2", "tp")


def test_heads_that_do_not_divide_are_refused(families: dict) -> None:
    message = _refusal(families["llama"][0], "4", "tp")
    assert "num_key_value_heads=2 (config.json), which 4 tensor-parallel ranks cannot split evenly" in message


def test_a_grad_allreduce_on_a_norm_that_is_not_per_head_is_refused() -> None:
    """replicated_with_grad_allreduce maps onto a split of its input's heads dim: on a norm of
    the whole hidden size (its input not split by heads) that would be wrong, so it is refused."""
    from composerun.models.hf_tp import hf_styles

    cfg = transformers.LlamaConfig(**COMMON)
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "layers.*.input_layernorm": "replicated_with_grad_allreduce"}
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.input_layernorm has transformers' tensor-parallel style "
                                          r"'replicated_with_grad_allreduce', which composerun does not map on a module "
                                          r"that is not a per-head norm"):  # fmt: skip
        hf_styles(model, "model.layers.0", False, 2, "rule")
    assert hf_styles(model, "", True, 2, "rule")["styles"]["lm_head"]["output_layouts"] == "shard(-1)"
