"""LoRA fine-tuning (`adapter=lora`) against an independent oracle: transformers' Llama with PEFT's
own LoRA layers (`peft.get_peft_model`), torch's AdamW, the schedule as specified, clipping by the
global norm of the trained parameters, the same windows (the data source's samples in order) and
the same initial adapters (PEFT's kaiming-uniform A drawn from the generator composerun documents
for it: models/lora.py, B zero).  composerun trains a tiny random Hugging Face Llama
(`+model=llama3 model.pretrained=DIR`) on mesh 1 (its blocks compiled), on mesh 2 (fully_shard:
frozen and trained parameters sharded together) and on mesh 2x2 (fsdp_tp: each adapter split as its base linear is,
models/lora.py); each run's losses are the oracle's within 1e-4 of its change, its
adapters the oracle's, its base weights the pretrained files' bit for bit; so is transformers' own
Llama (`+model=hf`) adapted on mesh 2.  Mesh 2's step-2 checkpoint resumed on mesh 1 (two
micro-batches a step) ends bit-equal to the uninterrupted run.  The issue's acceptance
command runs once as a user types it, and PEFT loads its export with composerun's logits.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import choose_start, cli, compose_node, latest_checkpoint, read_metrics
from safetensors.torch import load_file

from composerun.config import Config, to_typed, world_size_of
from composerun.config import validate as validate_config
from composerun.errors import ConfigError
from composerun.models import build_model
from composerun.models.hf import apply_pretrained

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ, STEPS, BATCH, RANK, ALPHA = 96, 16, 3, 4, 4, 8.0
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOOP = ["adapter=lora", f"adapter.rank={RANK}", f"adapter.alpha={ALPHA}", f"train.steps={STEPS}", "train.seed=3",
        "optim.warmup_steps=1", "optim.lr=2e-2", "optim.weight_decay=0.1", "optim.grad_clip=0.5",
        f"data.batch_size={BATCH}", "metrics.progress=false", "checkpoint.export=safetensors"]  # fmt: skip
FSDP_ROOT = "{match: '<root>', api: fully_shard}"


def make_llama(directory: Path, vocab: int = VOCAB, seed: int = 0) -> None:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def pretrained_config(directory: Path, *overrides: str) -> Config:
    """The config the ranks get for `+model=llama3 model.pretrained=DIR` (launch/job.py fills the dimensions)."""
    node = compose_node("+model=llama3", f"model.pretrained={directory}", f"model.seq_len={SEQ}", *overrides,
                        validate=False)  # fmt: skip
    apply_pretrained(node)
    validate_config(node)
    return to_typed(node)


def run(run_dir: Path, cfg: Config) -> dict[str, Any]:
    """conftest.train's launch, for a config whose dimensions come from a pretrained directory."""
    from composerun.launch.agent import launch

    run_dir.mkdir(parents=True)
    return launch(cfg, run_dir, world_size_of(cfg.mesh.shape), choose_start(cfg, run_dir))


def trained_model(run_dir: Path, cfg: Config) -> torch.nn.Module:
    """composerun's model with the adapters of the run's newest checkpoint (read by DCP in one process)
    on the base of the pretrained file (a checkpoint of an adapter run holds no base)."""
    model = build_model(cfg.model, cfg.adapter, cfg.train.seed)
    sd = model.state_dict()
    adapters = {k: v for k, v in sd.items() if ".lora_" in k}
    dcp.load({"model": adapters}, checkpoint_id=str(latest_checkpoint(run_dir)))
    files = load_file(str(Path(cfg.model.pretrained) / "model.safetensors"))
    base = {k: files[k if k == "lm_head.weight" else f"model.{k}"] for k in sd if k not in adapters}
    model.load_state_dict({**base, **adapters})
    return model.eval()


def initial_a(seed: int, fqn: str, shape: tuple[int, ...]) -> torch.Tensor:
    """PEFT's initialization of A (kaiming-uniform, a = sqrt(5)), from the generator that models/lora.py
    documents: seeded by the CRC-32 of `TRAIN_SEED/FQN`, composerun's FQN of the linear."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{fqn}".encode()))
    return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=g)


def oracle(
    directory: Path, cfg: Config, prefix: str = "base_model.model.model.", float8: bool = False, split: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, adapters before and after training, by composerun's keys) of the plain PEFT loop;
    `prefix`: what PEFT's names have before composerun's (`+model=hf` keeps transformers' `model.`);
    `float8`: PEFT's base linears converted by torchao (emulated float8 products), adapters as they are;
    `split`: each batch's forward and backward in that many equal pieces, their mean (as data-parallel
    ranks take them: float8 scales each piece's activations by its own amax)."""
    from composerun.data import build_data

    data = build_data(cfg)
    base = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS)
    model = peft.get_peft_model(base, lora).train()
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda m, fqn: fqn.endswith(".base_layer")
        )

    def ours(name: str) -> str:  # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
        return name.removeprefix(prefix).replace(".default.", ".")

    adapters = {ours(n): p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for key, p in adapters.items():
            if ".lora_A." in key:
                p.copy_(initial_a(cfg.train.seed, key.rsplit(".", 2)[0], tuple(p.shape)))
    before = {k: p.detach().clone() for k, p in adapters.items()}
    o = cfg.optim
    opt = torch.optim.AdamW(list(adapters.values()), lr=o.lr, weight_decay=o.weight_decay)
    losses = []
    for step in range(STEPS):
        if step < o.warmup_steps:  # linear warmup, then cosine to lr * min_lr_ratio at the last step
            scale = (step + 1) / (o.warmup_steps + 1)
        else:
            frac = (step - o.warmup_steps) / max(1, STEPS - 1 - o.warmup_steps)
            scale = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = o.lr * scale
        x, y = data.batch(range(step * BATCH, (step + 1) * BATCH))
        opt.zero_grad()
        loss = 0.0
        for xs, ys in zip(x.chunk(split), y.chunk(split), strict=True):
            piece = F.cross_entropy(model(input_ids=xs).logits.flatten(0, 1), ys.flatten()) / split
            piece.backward()
            loss += piece.item()
        losses.append(loss)
        torch.nn.utils.clip_grad_norm_(list(adapters.values()), o.grad_clip)
        opt.step()
    return losses, before, {k: p.detach().clone() for k, p in adapters.items()}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("lora") / "llama"
    make_llama(directory)
    return directory


@pytest.fixture(scope="module")
def runs(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Config]]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for mesh in ("1", "2", "2x2"):
        every = ["checkpoint.every=2"] if mesh == "2" else []  # (mesh 2's step-2 checkpoint: resumed on mesh 1 below)
        sharding = "sharding=fsdp_tp" if "x" in mesh else "sharding=fsdp"
        if mesh == "1":  # the adapted blocks compiled (aot_eager: dynamo's graphs without inductor's C++ build)
            sharding = f"sharding.rules=[{{match: 'layers.*', api: compile, backend: aot_eager}}, {FSDP_ROOT}]"
        cfg = pretrained_config(pretrained, f"mesh={mesh}", sharding, *LOOP, *every,
                                f"metrics.track_memory={mesh == '2'}")  # fmt: skip
        run(root / mesh, cfg)
        out[mesh] = (root / mesh, cfg)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["1", "2", "2x2"])
def test_lora_training_is_a_plain_peft_loop(runs: dict, pretrained: Path, mesh: str) -> None:
    run_dir, cfg = runs[mesh]
    if mesh == "1":
        assert json.loads((run_dir / "summary.json").read_text())["compiled_graphs"] >= 1  # the blocks ran compiled
    ref, before, after = oracle(pretrained, cfg)
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    change = abs(ref[-1] - ref[0])
    assert change > 1e-3, f"the oracle's loss barely moved ({ref})"
    assert len(losses) == STEPS and all(abs(a - b) <= 1e-4 * change for a, b in zip(losses, ref, strict=True)), (
        f"mesh {mesh}: losses {losses} != the PEFT loop's {ref}"
    )
    sd = trained_model(run_dir, cfg).state_dict()
    assert set(after) == {k for k in sd if ".lora_" in k} and len(after) == 2 * 2 * len(PROJECTIONS)
    # in the 2-norm over every adapter: Adam moves an element whose gradient is near zero by about lr
    # whatever that gradient's rounding (a sum in another order), so one element may differ by more
    moved = math.sqrt(sum(((after[k] - before[k]) ** 2).sum().item() for k in after))
    diff = math.sqrt(sum(((sd[k] - after[k]) ** 2).sum().item() for k in after))
    assert diff <= 1e-4 * moved, f"mesh {mesh}: adapters differ from the PEFT loop's by {diff:.3g} (moved {moved:.3g})"
    for k in after:  # every adapter trained: B away from zero, A away from its initial draw
        assert not torch.equal(sd[k], before[k]), f"mesh {mesh}: {k} did not move"
    assert_base_unmoved(run_dir, pretrained, sd, f"mesh {mesh}")


def assert_base_unmoved(run_dir: Path, pretrained: Path, adapters: dict[str, torch.Tensor], what: str) -> None:
    """The run's export (the ranks' live weights at the end) holds the pretrained file's base bit for bit
    and the checkpoint's adapters."""
    exported = load_file(str(run_dir / "export" / "model.safetensors"))
    files = load_file(str(pretrained / "model.safetensors"))
    base = {k: v for k, v in exported.items() if ".lora_" not in k}
    assert len(base) == len(files), what
    moved = [k for k, v in base.items() if not torch.equal(v, files[k if k == "lm_head.weight" else f"model.{k}"])]
    assert not moved, f"{what}: frozen base weights moved: {moved[:3]}"
    assert all(torch.equal(exported[k], adapters[k]) for k in exported if ".lora_" in k), what


@pytest.mark.distributed
def test_lora_on_a_transformers_model_is_the_peft_loop(pretrained: Path, tmp_path: Path) -> None:
    """`+model=hf` (transformers' own Llama, its FQNs `model.layers.N...`) with adapter=lora on mesh 2:
    its losses are the PEFT loop's within 1e-4 of their change, its live adapters at the end (the
    export) the loop's, and its base weights the pretrained file's bit for bit."""
    node = compose_node("+model=hf", f"model.pretrained={pretrained}", f"model.seq_len={SEQ}", "mesh=2",
                        "sharding=fsdp_blocks", *LOOP, "checkpoint=none", validate=False)  # fmt: skip
    apply_pretrained(node)
    validate_config(node)
    cfg = to_typed(node)
    run(tmp_path / "run", cfg)
    ref, before, after = oracle(pretrained, cfg, prefix="base_model.model.")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    change = abs(ref[-1] - ref[0])
    assert len(losses) == STEPS and all(abs(a - b) <= 1e-4 * change for a, b in zip(losses, ref, strict=True)), (
        f"+model=hf: losses {losses} != the PEFT loop's {ref}"
    )
    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert {k for k in exported if ".lora_" in k} == set(after) and len(after) == 2 * 2 * len(PROJECTIONS)
    moved = math.sqrt(sum(((after[k] - before[k]) ** 2).sum().item() for k in after))
    diff = math.sqrt(sum(((exported[k] - after[k]) ** 2).sum().item() for k in after))
    assert diff <= 1e-4 * moved, f"+model=hf: adapters differ from the PEFT loop's by {diff:.3g} (moved {moved:.3g})"
    files = load_file(str(pretrained / "model.safetensors"))
    base = {k: v for k, v in exported.items() if ".lora_" not in k}
    assert base.keys() == files.keys() and all(torch.equal(v, files[k]) for k, v in base.items())


@pytest.mark.distributed
def test_frozen_weights_have_no_optimizer_state(runs: dict) -> None:
    """The checkpoint's optimizer state covers the adapters only (the base is frozen)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(latest_checkpoint(runs["2"][0]))).read_metadata()
    state = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in meta.state_dict_metadata if k.startswith("optim.state.")}
    assert state and all(".lora_" in k for k in state), sorted(k for k in state if ".lora_" not in k)[:3]


@pytest.mark.distributed
def test_checkpoints_hold_the_adapters_and_resume_on_another_mesh(runs: dict, pretrained: Path, tmp_path: Path) -> None:
    """A checkpoint holds the adapters (no base weight) and the manifest the pretrained file's checksum;
    mesh 2's step-2 checkpoint (what a run killed after it leaves) resumed on mesh 1 with two
    micro-batches a step (each the samples one rank of mesh 2 took) trains step 3 only, reads the base
    from the files again, and ends with the uninterrupted run's adapters bit for bit; a resume
    against another base is refused before any rank starts, in one line."""
    import xxhash
    from torch.distributed.checkpoint import FileSystemReader

    run_dir, cfg = runs["2"]
    step2 = run_dir / "checkpoints" / "step-00000002"
    stored = {k for k in FileSystemReader(str(step2)).read_metadata().state_dict_metadata if k.startswith("model.")}
    assert stored and all(".lora_" in k for k in stored), sorted(k for k in stored if ".lora_" not in k)[:3]
    manifest = json.loads((step2 / "manifest.json").read_text())
    digest = xxhash.xxh3_128((pretrained / "model.safetensors").read_bytes()).hexdigest()
    assert manifest["base"] == {"pretrained": str(pretrained), "xxh3_128": {"model.safetensors": digest}}
    resumed = tmp_path / "resumed"
    over = ["mesh=1", "train.grad_accum=2", "sharding=fsdp", *LOOP, f"checkpoint.resume={step2}"]
    run(resumed, pretrained_config(pretrained, *over))
    assert [r["step"] for r in read_metrics(resumed) if "loss" in r] == [3]
    # the live weights at the end (each run's export): the adapters bit for bit, the base the files'
    want = load_file(str(run_dir / "export" / "model.safetensors"))
    got = load_file(str(resumed / "export" / "model.safetensors"))
    adapters = [k for k in want if ".lora_" in k]
    assert adapters and got.keys() == want.keys()
    differ = [k for k in adapters if not torch.equal(got[k], want[k])]
    assert not differ, f"resumed on mesh 1: adapters not bit-equal to the uninterrupted run's: {differ[:3]}"
    saved = {k: v for k, v in trained_model(run_dir, cfg).state_dict().items() if ".lora_" in k}
    dcp.load({"model": saved}, checkpoint_id=str(step2))
    assert any(not torch.equal(saved[k], got[k]) for k in saved)  # (step 3 trained after the load)
    assert_base_unmoved(resumed, pretrained, got, "resumed on mesh 1")
    other = tmp_path / "other"
    make_llama(other, seed=1)
    with pytest.raises(
        ConfigError, match=r"holds adapters trained on other base weights .* resume them on that base"
    ) as e:
        choose_start(pretrained_config(other, "mesh=1", *LOOP, f"checkpoint.resume={step2}"), tmp_path / "again")
    assert "\n" not in str(e.value)


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_the_hf_export_merges_the_adapters(runs: dict, pretrained: Path, tmp_path: Path, mesh: str) -> None:
    """A run's last checkpoint exported with checkpoint.export=hf on its own mesh (nothing left to
    train): transformers loads a plain Llama whose logits are composerun's adapted model's, and whose
    adapted weights moved off the base (the merge did something).  On mesh 2 (fully_shard) each rank
    adds its rows of B A; on 2x2 (fsdp_tp) W and its adapter are split on different dims."""
    run_dir, cfg = runs[mesh]
    last = latest_checkpoint(run_dir)
    sharding = "sharding=fsdp_tp" if "x" in mesh else "sharding=fsdp"
    over = [f"mesh={mesh}", sharding, *LOOP[:-1], "checkpoint.export=hf", f"checkpoint.resume={last}"]
    run(tmp_path / "run", pretrained_config(pretrained, *over))
    out = tmp_path / "run" / "export" / "hf"
    merged = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any(".lora_" in k for k in load_file(str(out / "model.safetensors")))
    files = load_file(str(pretrained / "model.safetensors"))
    assert not torch.equal(
        merged.state_dict()["model.layers.0.self_attn.q_proj.weight"], files["model.layers.0.self_attn.q_proj.weight"]
    )
    x = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (merged(input_ids=x).logits - trained_model(run_dir, cfg)(x)).abs().max().item()
    assert diff <= 1e-5, f"the merged export's logits differ from the adapted model's by {diff:.3g}"


@pytest.mark.distributed
def test_the_plan_counts_gradients_and_optimizer_state_of_the_adapters_only(runs: dict, pretrained: Path) -> None:
    """plan.json's bytes are what the mesh-2 run's ranks measured; over the ranks they add up to the
    adapters' size for gradients (AdamW: twice for its state) and to the pretrained file's for the
    frozen base; plan=true plans the same, and its estimate of each rank's peak is within 10 %."""
    from conftest import check_estimate

    from composerun.parallel.planner import plan_offline

    run_dir, cfg = runs["2"]
    plan, summary = (json.loads((run_dir / name).read_text()) for name in ("plan.json", "summary.json"))
    assert plan["bytes_per_rank"] == summary["measured_bytes_per_rank"]
    dim, ffn, layers = 32, 48, 2
    shapes = [
        (dim, dim),
        (dim, 16),
        (dim, 16),
        (dim, dim),
        (dim, ffn),
        (dim, ffn),
        (ffn, dim),
    ]  # (in, out) per projection
    adapters = 4 * layers * sum(RANK * (i + o) for i, o in shapes)
    assert sum(plan["bytes_per_rank"]["grads"]) == adapters and sum(plan["bytes_per_rank"]["optim"]) == 2 * adapters
    base = sum(t.numel() * 4 for t in load_file(str(pretrained / "model.safetensors")).values())
    assert sum(plan["frozen"]["bytes_per_rank"]) == base
    offline = plan_offline(cfg)[0]
    estimate = offline.pop("estimate")
    assert offline == plan
    check_estimate(estimate, summary, "lora on mesh 2")


@pytest.mark.e2e
def test_the_acceptance_command_exports_what_peft_loads(tmp_path: Path) -> None:
    """`composerun +model=llama3 model.pretrained=DIR adapter=lora data=tokens mesh=2 checkpoint.export=peft`
    trains with falling loss, and PEFT loads the export onto the base with composerun's logits; the
    command line's export of the run's checkpoint is the same directory."""
    source = tmp_path / "pretrained"
    make_llama(source, vocab=2048)  # (the shipped tokens' vocabulary)
    over = [f"model.pretrained={source}", "adapter=lora", "data=tokens", "mesh=2", "checkpoint.export=peft"]
    r = cli("+model=llama3", *over, "model.seq_len=32", "train.steps=4", "optim.lr=2e-2", "optim.warmup_steps=0",
            "metrics.track_memory=false", "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir, export = tmp_path / "run", tmp_path / "run" / "export" / "peft"
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert losses[-1] < losses[0], losses
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and len(config["target_modules"]) == 2 * len(PROJECTIONS)
    base = transformers.LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, export).eval()
    cfg = pretrained_config(source, "model.seq_len=32", *over[1:])
    ours = trained_model(run_dir, cfg)
    x = torch.randint(2048, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded(input_ids=x).logits, ours(x)
        with loaded.disable_adapter():
            plain = loaded(input_ids=x).logits
    assert (got - plain).abs().max() > 1e-3, "the adapters changed nothing: a test that cannot fail"
    assert (got - want).abs().max().item() <= 1e-5
    from composerun.checkpoint.cli import main

    with pytest.raises(SystemExit) as done:
        main(["export", str(run_dir), "--format", "peft", str(tmp_path / "again")])
    assert done.value.code == 0
    again = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    written = load_file(str(export / "adapter_model.safetensors"))
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)


def float8_rank(cfg: Config, run_dir: str, start: Any) -> dict[str, Any]:
    """A rank of composerun's run with torchao's emulated float8 products (a CPU has no float8 ones)."""
    from composerun.parallel import float8
    from composerun.train.run import run as run_rank

    float8.EMULATE = True
    return run_rank(cfg, run_dir, start)


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["2"])  # (mesh 1 is the same loop unsplit: left out for the suite's time)
def test_lora_on_float8_linears_is_the_peft_loop_on_torchaos(runs: dict, pretrained: Path, tmp_path: Path, mesh: str):
    """sharding=fsdp_blocks_float8 with adapter=lora: the blocks' base linears become torchao's
    Float8Linear (emulated products) and keep their adapters, the blocks compiled (aot_eager); the
    losses and adapters are the PEFT loop's with torchao's conversion of PEFT's base layers (on mesh
    2, each rank's half of a batch scaled on its own, as the loop's halves are), and not the fp32
    run's (float8 ran)."""
    pytest.importorskip("torchao")
    from composerun.config.schema import LaunchConfig, StartMethod
    from composerun.launch.agent import start_ranks

    # the shipped policy, its compile rule on aot_eager as mesh 1's above: float8's products are
    # emulated on a CPU, so inductor's C++ kernels for them are of no run a user makes
    cfg = pretrained_config(pretrained, f"mesh={mesh}", "sharding=fsdp_blocks_float8", "sharding.rules.1.backend=aot_eager",
                            *LOOP[:-1])  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    start = choose_start(cfg, run_dir)
    start_ranks(
        float8_rank, (cfg, str(run_dir), start), int(mesh), run_dir, LaunchConfig(start_method=StartMethod.forkserver)
    )
    assert json.loads((run_dir / "summary.json").read_text())["compiled_graphs"] >= 1  # the blocks ran compiled
    plan = json.loads((run_dir / "plan.json").read_text())
    f8 = next(u for u in plan["units"] if u["fqn"] == "layers.0")["api_options"]["float8"]
    assert sorted(f8["converted"]) == sorted(
        f"{p}.{n}" for p in ("self_attn", "mlp") for n in PROJECTIONS if (n[0] in "qkvo") == (p == "self_attn")
    )
    ref, before, after = oracle(pretrained, cfg, float8=True, split=int(mesh))
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    fp32 = [r["loss"] for r in read_metrics(runs["1"][0]) if "loss" in r]
    change = abs(ref[-1] - ref[0])
    assert losses != fp32 and ref != fp32  # float8 ran, in both
    assert all(abs(a - b) <= 1e-4 * change for a, b in zip(losses, ref, strict=True)), (
        f"mesh {mesh}: losses {losses} != the PEFT loop's on torchao's float8 {ref}"
    )
    sd = trained_model(run_dir, cfg).state_dict()
    moved = math.sqrt(sum(((after[k] - before[k]) ** 2).sum().item() for k in after))
    diff = math.sqrt(sum(((sd[k] - after[k]) ** 2).sum().item() for k in after))
    assert diff <= 1e-4 * moved, f"mesh {mesh}: adapters differ from the PEFT loop's by {diff:.3g} (moved {moved:.3g})"


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["adapter.rank=0"], r"^adapter\.rank=0: must be at least 1"),
        (["adapter.targets=[nope]"], r"^adapter\.targets=\['nope'\]: match no linear of the model \(its linears"),
        (["adapter.targets=[layers.0]"], r"^adapter\.targets=\['layers\.0'\]: layers\.0 is a LlamaBlock, not an nn\.Linear"),
        (["adapter=none", "checkpoint.export=peft"], r"^checkpoint\.export=peft: the run has no adapter"),
        (["adapter.train=[nothing.here]"], r"^adapter\.train: nothing\.here matches no parameter"),
    ],
)  # fmt: skip
def test_bad_adapter_input_is_one_line(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError, match=line) as e:
        cfg = to_typed(compose_node("+model=llama3_debug", "adapter=lora", *overrides))
        with torch.device("meta"):
            build_model(cfg.model, cfg.adapter, cfg.train.seed)
    assert "\n" not in str(e.value)


def test_export_peft_with_trained_base_parameters_is_refused(pretrained: Path) -> None:
    from composerun.checkpoint.hf_export import check_export

    cfg = pretrained_config(pretrained, "adapter=lora", "adapter.train=[norm.weight]", "checkpoint.export=peft")
    with pytest.raises(ConfigError, match=r"^checkpoint\.export=peft: adapter\.train=\['norm\.weight'\] trains base"):
        check_export(cfg)


def test_the_base_state_dict_keys_are_unchanged() -> None:
    """An adapter adds its own keys and renames none of the base's; only adapters (and adapter.train) train."""
    cfg = to_typed(compose_node("+model=llama3_debug", "adapter=lora", "adapter.train=[norm.weight]"))
    with torch.device("meta"):
        plain, adapted = build_model(cfg.model), build_model(cfg.model, cfg.adapter)
    keys = list(adapted.state_dict())
    assert [k for k in keys if ".lora_" not in k] == list(plain.state_dict())
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained == {k for k in keys if ".lora_" in k} | {"norm.weight"} and len(trained) == 1 + 2 * 4 * len(
        PROJECTIONS
    )
