"""Any Hugging Face causal LM (`+model=hf model.pretrained=DIR`), family by family, against
transformers itself (a test-only dependency; nothing from the hub).

Each family's tiny random model is made here by transformers and saved with `save_pretrained`:
Llama, Qwen2, Qwen3 (tied embeddings), Mistral, Gemma 3 (text), Phi-3 and the mixture of
experts Qwen3-MoE (4 experts, top 2, sharded by FSDP), each with a generation config of
non-default values and a small BPE tokenizer (Qwen2's as vocab.json and merges.txt, the others'
as transformers saves one).  On meshes 1 and 2 (fsdp_blocks) for every family, and on 2x2
(hsdp_blocks) for a dense, a tied and the mixture of experts (ON_MESH), composerun's logits of
the same tokens are transformers' own within 1e-5 (fp32), and the parameters it loaded are
from_pretrained's bit for bit, the families in one launch per mesh.  On mesh 2 each family
trains three steps, and the trained change of its loss is that of a plain transformers +
torch.optim.AdamW loop (the same windows, schedule and clipping) within 1e-4 (a mixture of
experts: no token's routing near a tie, ROUTING_MARGIN); its `checkpoint.export=hf` (and
composerun-ckpt's export of its step-2 checkpoint) loads in transformers with the oracle's
logits at that step, the source's generation config and a tokenizer that tokenizes as the
source's, and its step-2 checkpoint resumed on one rank ends where it ended.  A directory composerun cannot take is
refused in one line, and a wrong initialization (a zeroed rotary table) stops the run before
its first step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import check_estimate, choose_start, compose_node, latest_checkpoint, read_metrics
from fixtures.hf_any import logits_then_train, train_each, train_with_zeroed_rotary

from composerun.checkpoint.cli import main
from composerun.config import Config, to_typed, world_size_of
from composerun.config import validate as validate_config
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.errors import ConfigError, RunFailed
from composerun.launch.agent import start_ranks
from composerun.models.hf import apply_pretrained

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS, BATCH = 96, 16, 3, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
FAMILIES: dict[str, Any] = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
    "phi3": lambda: transformers.Phi3Config(**COMMON, tie_word_embeddings=False, pad_token_id=0),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=8, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, tie_word_embeddings=False),
}  # fmt: skip
MESHES = {"1": "fsdp_blocks", "2": "fsdp_blocks", "2x2": "hsdp_blocks"}
# The families set up on 2x2: what HSDP adds to mesh 2's sharding (the same split of every tensor
# over 2 ranks, each family's on mesh 2) is a replica dimension, which does not depend on the
# family but on the kinds of parameter it replicates: a dense untied model, tied embeddings (one
# tensor under two names) and a mixture of experts' fused expert tensors
ON_MESH = {"1": list(FAMILIES), "2": list(FAMILIES), "2x2": ["llama", "qwen3", "qwen3_moe"]}
CELLS = [(family, mesh) for mesh, families in ON_MESH.items() for family in families]
LOOP = ["train.steps=3", "train.log_every=1", "optim.warmup_steps=1", "optim.schedule=cosine", "optim.lr=1e-2",
        "optim.weight_decay=0.1", "optim.grad_clip=0.5", f"data.batch_size={BATCH}", "metrics.progress=false"]  # fmt: skip
TRAIN = [*LOOP, "checkpoint.export=hf", "checkpoint.every=2"]
# a run whose peak memory no test reads: no step under torch's memory tracker (every op of it
# dispatched in Python); the mesh-2 runs measure theirs for the estimate
UNMEASURED = ["metrics.track_memory=false"]


TEXT = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer"
CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
# generation_config.json's values in the source directory, none of them transformers' default
GENERATION = dict(do_sample=True, temperature=0.7, top_k=7, top_p=0.9, max_new_tokens=17, repetition_penalty=1.1)
OLD_STYLE_TOKENIZER = "qwen2"  # its directory holds vocab.json and merges.txt, no tokenizer.json


def make(directory: Path, family: str) -> Any:
    """The family's tiny random model as transformers saves it, with a generation config of
    non-default values and a byte-level BPE tokenizer of its own (fewer tokens than VOCAB)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():  # norms away from their initial values, so that loading them matters
        for key, p in model.named_parameters():
            if "norm" in key:
                p.uniform_(0.5, 1.5) if p.mean() > 0.5 else p.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    transformers.GenerationConfig(**GENERATION, bos_token_id=1, eos_token_id=2).save_pretrained(directory)
    save_tokenizer(directory, old_style=family == OLD_STYLE_TOKENIZER)
    return model


def bpe() -> Any:
    """A byte-level BPE tokenizer trained on TEXT (the tokenizers library's object: the reference)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<unk>", "<s>", "</s>"]))
    return tok


def save_tokenizer(directory: Path, old_style: bool) -> None:
    """bpe() in `directory` as transformers saves it (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), or as older directories hold one: vocab.json, merges.txt and a
    tokenizer_config.json naming the class."""
    tok = bpe()
    special = dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if old_style:
        tok.model.save(str(directory))
        config = {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, **special, "chat_template": CHAT}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, **special, model_max_length=COMMON["max_position_embeddings"]
        )
        fast.chat_template = CHAT
        fast.save_pretrained(directory)


def config(directory: Path, *overrides: str) -> Config:
    """The config the ranks get for `+model=hf model.pretrained=DIR` (launch/job.py fills it).
    DIR is set after composing, so that one composition (conftest's, cached by its overrides)
    serves every family's directory."""
    node = compose_node("+model=hf", f"model.seq_len={SEQ}", "checkpoint=none", *overrides, validate=False)
    node.model.pretrained = str(directory)
    apply_pretrained(node)
    validate_config(node)
    return to_typed(node)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("families")
    return {f: (root / f, make(root / f, f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def on_meshes(families: dict, tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per mesh, every rank's logits and rank 0's loaded parameters per family of ON_MESH; mesh 2
    also trains each family (one launch per mesh)."""
    out = {}
    for mesh, policy in MESHES.items():
        root = tmp_path_factory.mktemp(f"mesh{mesh}")
        over = [f"mesh={mesh}", f"sharding={policy}"]
        jobs = [(f, config(families[f][0], *over), config(families[f][0], *over, *TRAIN) if mesh == "2" else None)
                for f in ON_MESH[mesh]]  # fmt: skip
        world = world_size_of(jobs[0][1].mesh.shape)
        ranks = start_ranks(logits_then_train, (jobs, tokens, str(root)), world, root,
                            LaunchConfig(start_method=StartMethod.forkserver))  # fmt: skip
        out[mesh] = {"ranks": ranks, "root": root, "cfg": {f: t for f, _, t in jobs}}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "mesh"), CELLS)
def test_logits_are_transformers(on_meshes: dict, families: dict, tokens: torch.Tensor, mesh: str, family: str) -> None:
    hf = families[family][1]
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
    for rank, got in on_meshes[mesh]["ranks"].items():
        diff = (got["logits"][family] - ref).abs().max().item()
        assert diff <= 1e-5, f"{family} on mesh {mesh}, rank {rank}: logits differ by {diff:.3g}"


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "mesh"), CELLS)
def test_the_loaded_parameters_are_from_pretrained(on_meshes: dict, families: dict, mesh: str, family: str) -> None:
    """Every parameter each rank read of DIR, gathered, is the one transformers' from_pretrained
    loads, bit for bit: a mixture of experts' fused experts too (composed from one file tensor
    per expert and projection by transformers' own conversion)."""
    ours = on_meshes[mesh]["ranks"][0]["params"][family]
    ref = transformers.AutoModelForCausalLM.from_pretrained(families[family][0], dtype=torch.float32).state_dict()
    assert ours and set(ours) <= set(ref), sorted(set(ours) - set(ref))
    differ = [k for k in ours if not torch.equal(ours[k], ref[k])]
    assert not differ, f"{family} on mesh {mesh}: {differ[:3]} differ from from_pretrained's"


_ORACLES: dict[str, tuple[list[float], Any, list[dict[str, torch.Tensor]], float]] = {}
# a mixture of experts' routing is discrete: each token's k-th expert must beat its next, in the oracle's
# router probabilities, by far more than composerun's float32 arithmetic can move them (a rounding of
# the order of 1e-7), so that no token takes another expert in one loop and not in the other: the
# seeds and sizes are chosen for that, and the oracle checks it rather than assume it
ROUTING_MARGIN = 2e-5


def oracle(family: str, directory: Path, cfg: Config) -> tuple[list[float], Any, list[dict[str, torch.Tensor]], float]:
    """(the oracle's losses, its trained model, its weights after each step, the smallest routing
    margin), computed once per family."""
    if family not in _ORACLES:
        _ORACLES[family] = oracle_run(directory, cfg)
    return _ORACLES[family]


def oracle_run(directory: Path, cfg: Config) -> tuple[list[float], Any, list[dict[str, torch.Tensor]], float]:
    """The losses of a plain loop: transformers' model from DIR, torch's AdamW, the schedule as
    specified (tests/test_oracle.py's), clipping by the global gradient norm, the same windows
    (the data source's samples in order); and, of a mixture of experts, the smallest margin by
    which a token's k-th expert beat its next (router probabilities; inf without a router)."""
    from composerun.data import build_data

    data = build_data(cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    margins = [math.inf]

    def margin(module: Any, args: Any, output: Any) -> None:
        top = output[0].detach().softmax(-1).sort(-1, descending=True).values
        margins.append((top[:, module.top_k - 1] - top[:, module.top_k]).min().item())

    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(margin)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    steps, warm, floor = cfg.train.steps, o.warmup_steps, o.min_lr_ratio
    out, weights = [], []
    for step in range(steps):
        if step < warm:  # linear warmup, then cosine to lr * min_lr_ratio at the last step
            scale = (step + 1) / (warm + 1)
        else:
            frac = (step - warm) / max(1, steps - 1 - warm)
            scale = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = o.lr * scale
        x, y = data.batch(range(step * BATCH, (step + 1) * BATCH))
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        out.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        weights.append({k: t.detach().clone() for k, t in model.state_dict().items()})
    return out, model.eval(), weights, min(margins)


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_is_a_plain_transformers_loop(on_meshes: dict, families: dict, family: str) -> None:
    run = on_meshes["2"]
    losses = [r["loss"] for r in read_metrics(run["root"] / f"{family}-train") if "loss" in r]
    ref, _, _, routing = oracle(family, families[family][0], run["cfg"][family])
    assert routing > ROUTING_MARGIN, f"{family}: a token's experts were within {routing:.2g} of a tie"
    assert_like_oracle(family, losses, ref)


def assert_like_oracle(family: str, losses: list[float], ref: list[float]) -> None:
    assert len(losses) == STEPS
    change = abs(ref[-1] - ref[0])
    assert change > 1e-3, f"{family}: the oracle's loss barely moved ({ref})"
    for got, want in zip(losses, ref, strict=True):
        assert abs(got - want) <= 1e-4 * change, f"{family}: losses {losses} != oracle {ref}"


# sharding=fsdp_blocks_compile as shipped, on aot_eager (dynamo's graphs and AOT autograd as inductor
# gets them, without inductor's C++ compilation) and fullgraph (a graph break fails the compile)
COMPILED = ["sharding=fsdp_blocks_compile", "sharding.rules.0.backend=aot_eager", "sharding.rules.0.fullgraph=true"]


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_compiles_per_layer(families: dict, mesh: Any, tmp_path: Path, family: str) -> None:
    """The family's decoder layers compiled, on one rank in this process (the compiler's counters
    are per process): its two layers run one compiled graph, every step (summary.json's
    compiled_graphs), and three steps train as the plain transformers loop does."""
    import torch._dynamo

    from composerun.train.run import train

    directory = families[family][0]
    cfg = config(directory, "mesh=1", *COMPILED, *LOOP, "model.verify_pretrained=false", *UNMEASURED)
    assert [r.api.value for r in cfg.sharding.rules][:1] == ["compile"] and cfg.sharding.rules[0].fullgraph
    torch._dynamo.reset()  # its count is its own
    summary = train(cfg, tmp_path, mesh, torch.device("cpu"))
    assert summary["compiled_graphs"] == 1, f"{family}: {summary['compiled_graphs']} graphs compiled"
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert_like_oracle(family, losses, oracle(family, directory, cfg)[0])


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["run", "command_line"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_export_is_the_trained_model_in_transformers(on_meshes: dict, families: dict, tokens: torch.Tensor,
                                                          family: str, how: str, tmp_path: Path) -> None:  # fmt: skip
    """checkpoint.export=hf of the mesh-2 run (and `composerun-ckpt export --format hf` of its
    step-2 checkpoint) loads in transformers as it is, with the source's config.json,
    generation_config.json and tokenizer files beside its weights: its logits are those of the
    oracle's model after as many steps within 1e-4, its generation config the source's, and its
    tokenizer tokenizes and applies the chat template as the source's tokenizer does."""
    run, source = on_meshes["2"], families[family][0]
    _, trained, weights, _ = oracle(family, source, run["cfg"][family])
    out = run["root"] / f"{family}-train" / "export" / "hf"
    if how == "command_line":  # the step-2 checkpoint (the last one: checkpoint.every=2, none at the end)
        out, ckpt = tmp_path / "hf", latest_checkpoint(run["root"] / f"{family}-train")
        assert ckpt.name == "step-00000002", ckpt
        with pytest.raises(SystemExit) as done:
            main(["export", str(ckpt), "--format", "hf", str(out)])
        assert done.value.code == 0
        trained = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        trained.load_state_dict(weights[1])
    want = json.loads((source / "config.json").read_text())
    have = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in have.items() if k != "dtype"} == {k: v for k, v in want.items() if k != "dtype"}
    beside = {p.name for p in source.iterdir()} - {"config.json", "model.safetensors"}
    assert beside >= {"generation_config.json", "tokenizer_config.json"}, beside
    for name in beside:  # the tokenizer's files, whichever they are, and the generation config
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation == transformers.GenerationConfig.from_pretrained(source)
    assert {k: getattr(generation, k) for k in GENERATION} == GENERATION
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sample = "Whether to be nobler, or not"
    assert tok(sample)["input_ids"] == bpe().encode(sample).ids
    assert tok.apply_chat_template([{"role": "user", "content": "to be"}], tokenize=False) == "<s>user: to be</s>"
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (exported(input_ids=tokens).logits - trained(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, f"{family}: the export's logits differ from the trained oracle's by {diff:.3g}"


@pytest.mark.distributed
def test_a_checkpoint_resumes_on_another_mesh(on_meshes: dict, families: dict, tmp_path: Path) -> None:
    """Every family's mesh-2 checkpoint of step 2, resumed on one rank for its last step, ends
    within 1e-6 of the uninterrupted mesh-2 run (their exports, tensor by tensor), with the same
    tensor names."""
    from safetensors.torch import load_file

    run = on_meshes["2"]
    jobs = []
    for family, (directory, _) in families.items():
        ckpt = run["root"] / f"{family}-train" / "checkpoints" / "step-00000002"
        assert ckpt.is_dir(), f"{family}: no step-2 checkpoint in {sorted(ckpt.parent.iterdir())}"
        cfg = config(directory, "mesh=1", "sharding=fsdp_blocks", *TRAIN, f"checkpoint.resume={ckpt}", *UNMEASURED)
        (tmp_path / family).mkdir()
        jobs.append((family, cfg, choose_start(cfg, tmp_path / family)))  # what the launcher hands the ranks
    summaries = start_ranks(train_each, (jobs, str(tmp_path)), 1, tmp_path,
                            LaunchConfig(start_method=StartMethod.forkserver))[0]  # fmt: skip
    for family in families:
        assert summaries[family]["start_step"] == 2, summaries[family]
        straight = load_file(str(run["root"] / f"{family}-train" / "export" / "hf" / "model.safetensors"))
        resumed = load_file(str(tmp_path / family / "export" / "hf" / "model.safetensors"))
        assert set(resumed) == set(straight), family
        worst = max((resumed[k] - straight[k]).abs().max().item() for k in straight)
        assert worst <= 1e-6, f"{family}: resumed on one rank differs from the mesh-2 run by {worst:.3g}"


# --- a directory composerun cannot take: one line, before any rank starts ------------------------------

BAD = {
    "not_causal": ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]},
                   r"is for T5ForConditionalGeneration, not a causal language model"),
    "remote_code": ({"model_type": "mine", "auto_map": {"AutoModelForCausalLM": "mine.MyLM"}},
                    r"names code of the directory's own \(auto_map\); .*model\.trust_remote_code=true"),
    "unknown_type": ({"model_type": "no_such_model"}, r"model_type 'no_such_model' is not one transformers .* knows"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_a_directory_composerun_cannot_take_is_one_line(tmp_path: Path, case: str) -> None:
    content, message = BAD[case]
    (tmp_path / "config.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=message):
        config(tmp_path)


def test_hf_without_a_directory_is_one_line() -> None:
    node = compose_node("+model=hf", validate=False)
    with pytest.raises(ConfigError, match=r"model\.pretrained: \+model=hf .* give model\.pretrained=DIR"):
        apply_pretrained(node)


# --- the first-forward check: a wrong initialization stops the run -----------------------------------


@pytest.mark.distributed
def test_a_zeroed_rotary_table_stops_the_run_in_one_line(families: dict, tmp_path: Path) -> None:
    """The model's rotary table zeroed after allocation (what meta-device building does to a
    buffer nobody computes again): the run stops before its first step, in one line naming
    the check; with model.verify_pretrained=false it trains (the check is what stopped it)."""
    directory = families["llama"][0]
    cfg = config(directory, "mesh=1", "sharding=fsdp_blocks", "train.steps=1", "metrics.progress=false")
    with pytest.raises(RunFailed, match=r"the loaded model's logits differ from transformers' own by .*"
                                         r"model\.verify_pretrained=false skips this check") as e:  # fmt: skip
        start_ranks(train_with_zeroed_rotary, (cfg, str(tmp_path / "a")), 1, tmp_path / "a",
                    LaunchConfig(start_method=StartMethod.forkserver))  # fmt: skip
    assert "\n" not in str(e.value)
    off = config(directory, "mesh=1", "sharding=fsdp_blocks", "train.steps=1", "metrics.progress=false",
                 "model.verify_pretrained=false", *UNMEASURED)  # fmt: skip
    start_ranks(train_with_zeroed_rotary, (off, str(tmp_path / "b")), 1, tmp_path / "b",
                LaunchConfig(start_method=StartMethod.forkserver))  # fmt: skip
    assert [r["step"] for r in read_metrics(tmp_path / "b") if "loss" in r] == [1]


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_estimate_is_what_the_ranks_measured(on_meshes: dict, family: str) -> None:
    """plan=true's estimate of each rank's peak memory (one step on fake tensors, through
    transformers' own modules) is within ESTIMATE_RTOL of the peak the mesh-2 run's ranks
    measured on their tracked step."""
    from composerun.parallel.planner import plan_offline

    run = on_meshes["2"]
    summary = json.loads((run["root"] / f"{family}-train" / "summary.json").read_text())
    check_estimate(plan_offline(run["cfg"][family])[0]["estimate"], summary, family)
