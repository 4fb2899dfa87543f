"""Hugging Face Llama checkpoints in (`+model=llama3 model.pretrained=DIR`), against
transformers' own `LlamaForCausalLM` (a test-only dependency; nothing from the hub).

Tiny random models are made here with transformers and saved with its `save_pretrained`:
grouped-query attention, Llama 3 rope scaling or the default rope, rms_norm_eps 1e-5 or the
library's default (1e-6), untied or tied embeddings, one `model.safetensors` or several files
and an index, and a tied directory that also stores `lm_head.weight` and a rotary `inv_freq`
(which composerun ignores).  composerun sets each up on meshes 1, 2 (fsdp_blocks) and 2x2
(hsdp_blocks), as a run does (train/setup.py), and its logits and loss of the same tokens are
transformers' own within 1e-5; each rank reads exactly the rows it holds.  One training step
from the pretrained weights gives the loss a transformers + torch.optim.AdamW step gives.
A directory whose files do not fit is refused before any rank starts, in one line.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import choose_start, compose_node, patience, read_metrics
from fixtures.hf import pretrained_logits
from safetensors.torch import load_file, save_file

from composerun.config import Config, to_typed, world_size_of
from composerun.config import validate as validate_config
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.errors import ConfigError
from composerun.launch.agent import launch, start_ranks
from composerun.models.hf import apply_pretrained

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
# name: (tied, rms_norm_eps (None: transformers' default), rope_parameters (None: default rope), max_shard_size)
MODELS = {
    "untied": (False, 1e-5, LLAMA3_ROPE, None),
    "tied_sharded": (True, None, None, "20KB"),
    "tied_with_head": (True, 1e-5, LLAMA3_ROPE, None),
}
MESHES = {"1": "fsdp", "2": "fsdp_blocks", "2x2": "hsdp_blocks"}


def make_pretrained(directory: Path, name: str, seed: int = 0) -> Any:
    """A random LlamaForCausalLM saved to `directory` as save_pretrained writes it; the model."""
    tied, eps, rope, shard = MODELS[name]
    extra = {"rms_norm_eps": eps} if eps is not None else {}
    if rope is not None:
        extra["rope_parameters"] = rope
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that loading them matters
        for key, p in model.named_parameters():
            if "norm" in key:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    if name == "tied_with_head":  # some tied directories hold the head too, and older ones inv_freq
        sd = load_file(str(directory / "model.safetensors"))
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return model


def pretrained_config(directory: Path, *overrides: str) -> Config:
    """The config the ranks get for `+model=llama3 model.pretrained=DIR` (the launcher fills
    the model's dimensions from DIR/config.json: launch/job.py)."""
    node = compose_node("+model=llama3", f"model.pretrained={directory}", f"model.seq_len={SEQ}", *overrides,
                        validate=False)  # fmt: skip
    apply_pretrained(node)
    validate_config(node)
    return to_typed(node)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, make_pretrained(root / name, name)) for name in MODELS}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def on_meshes(pretrained: dict, tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per mesh, every rank's {model name: logits, reads, shard bytes}: one launch per mesh."""
    out = {}
    for mesh, policy in MESHES.items():
        root = tmp_path_factory.mktemp(f"mesh{mesh}")
        jobs = [(n, pretrained_config(d, f"mesh={mesh}", f"sharding={policy}", "checkpoint=none"))
                for n, (d, _) in pretrained.items()]  # fmt: skip
        world = world_size_of(jobs[0][1].mesh.shape)
        out[mesh] = start_ranks(pretrained_logits, (jobs, tokens, str(root)), world, root,
                                LaunchConfig(start_method=StartMethod.forkserver))  # fmt: skip
    return out


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


# --- numerics against transformers ----------------------------------------------------------------


def test_the_models_cover_the_cases(pretrained: dict) -> None:
    """GQA, both rope kinds and both eps, tied and untied, a single file and an index."""
    cfgs = {n: json.loads((d / "config.json").read_text()) for n, (d, _) in pretrained.items()}
    assert all(c["num_key_value_heads"] < c["num_attention_heads"] for c in cfgs.values())
    assert {c["rms_norm_eps"] for c in cfgs.values()} == {1e-5, 1e-6}
    assert {c["tie_word_embeddings"] for c in cfgs.values()} == {True, False}
    assert cfgs["untied"]["rope_parameters"]["rope_type"] == "llama3"
    assert cfgs["tied_sharded"]["rope_parameters"]["rope_type"] == "default"
    d = pretrained["tied_sharded"][0]
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) >= 3
    assert "lm_head.weight" in file_tensors(pretrained["tied_with_head"][0])


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_loss_are_transformers(on_meshes: dict, pretrained: dict, tokens: torch.Tensor, mesh: str,
                                          name: str) -> None:  # fmt: skip
    """Every rank's logits of the tokens are transformers' forward's within 1e-5 (fp32), and so
    is the next-token loss (transformers' own, from labels)."""
    hf = pretrained[name][1]
    with torch.no_grad():
        ref = hf(input_ids=tokens, labels=tokens)
    for rank, rows in on_meshes[mesh].items():
        logits = rows[name]["logits"]
        assert logits.shape == ref.logits.shape
        diff = (logits - ref.logits).abs().max().item()
        assert diff <= 1e-5, f"mesh {mesh} rank {rank}: logits differ by {diff:.3g}"
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert abs(loss.item() - ref.loss.item()) <= 1e-5, f"mesh {mesh} rank {rank}: loss {loss} != {ref.loss}"


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_each_rank_reads_only_the_rows_it_holds(on_meshes: dict, pretrained: dict, mesh: str) -> None:
    """No rank reads a whole tensor: under FSDP over N ranks (HSDP: N per replica) each reads
    only the rows of dim 0 it holds, exactly as many bytes as it holds, which is (model bytes)
    / N; the rows of every tensor are read once by each replica.  An lm_head.weight of a tied
    directory, or a stored inv_freq, is never read."""
    ranks = on_meshes[mesh]
    replicas = 2 if mesh == "2x2" else 1
    for name, (directory, hf) in pretrained.items():
        stored = file_tensors(directory)
        total = sum(p.numel() * p.element_size() for p in hf.parameters())  # the model's bytes (a tied head once)
        largest = max(p.numel() * p.element_size() for p in hf.parameters())
        covered: dict[str, int] = {}
        for rank, rows in ranks.items():
            reads = rows[name]["reads"]
            whole = [k for k, r, _ in reads if r is None]
            assert not whole, f"mesh {mesh} rank {rank} read whole tensors: {whole[:3]}"
            nbytes = sum(b for *_, b in reads)
            holds = rows[name]["shard_bytes"]
            assert nbytes == holds, f"mesh {mesh} rank {rank}: read {nbytes} bytes, holds {holds}"
            bound = total * replicas / len(ranks) + largest  # (model bytes) / N + one tensor
            assert nbytes <= bound, f"mesh {mesh} rank {rank}: read {nbytes} of {total} bytes"
            for key, (a, b), _ in reads:
                covered[key] = covered.get(key, 0) + b - a
            if MODELS[name][0]:
                assert not {k for k, *_ in reads} & {"lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"}
        for key, n in covered.items():
            assert n == replicas * stored[key].shape[0], (
                f"{name}: rows of {key} read {n} times over {replicas} replicas"
            )


def test_one_rank_reads_the_model_once(on_meshes: dict, pretrained: dict) -> None:
    """On one rank the model is read once, whole (a tied head once: the embedding)."""
    for name, (_, hf) in pretrained.items():
        want = sum(p.numel() * p.element_size() for p in hf.parameters())  # (a tied head counted once)
        assert sum(b for *_, b in on_meshes["1"][0][name]["reads"]) == want


@pytest.mark.distributed
def test_one_training_step_is_transformers_and_adamw(pretrained: dict, tmp_path: Path) -> None:
    """composerun's step-2 loss (after one AdamW step on batch 1) on mesh 2 equals that of
    transformers' model stepped by torch.optim.AdamW on the same batch (the data source's
    samples 0..3, then 4..7), and the step-1 loss is transformers' loss at the pretrained
    weights."""
    directory, _ = pretrained["untied"]
    lr, wd, batch = 1e-2, 0.1, 4
    overrides = ["mesh=2", "sharding=fsdp_blocks", "train.steps=2", "optim.grad_clip=0", "optim.warmup_steps=0",
                 "optim.schedule=constant", f"optim.lr={lr}", f"optim.weight_decay={wd}", f"data.batch_size={batch}",
                 "checkpoint=none", "launch.start_method=forkserver", "metrics.progress=false"]  # fmt: skip
    cfg = pretrained_config(directory, *overrides)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launch(cfg, run_dir, 2, choose_start(cfg, run_dir))
    losses = {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}

    from composerun.data import build_data

    data = build_data(cfg)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=wd)
    ref = []
    for step in range(2):
        x, y = data.batch(range(step * batch, (step + 1) * batch))
        loss = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
        ref.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(losses[1] - ref[0]) <= 1e-5, (losses, ref)
    assert abs(losses[2] - ref[1]) <= 1e-5, (losses, ref)
    assert abs(ref[1] - ref[0]) > 1e-3, "the step moved the weights enough to tell"


# --- a directory that does not fit: refused before any rank starts ---------------------------------


def _check(directory: Path) -> None:
    """What the launcher checks of model.pretrained (launch/preflight.py), with the model
    config.json describes."""
    from composerun.checkpoint.hf_import import check_pretrained
    from composerun.launch.preflight import meta_model, model_shapes

    cfg = pretrained_config(directory)
    check_pretrained(directory, model_shapes(meta_model(cfg)))


def _rewrite(path: Path, change: Any) -> None:
    sd = load_file(str(path))
    change(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


BROKEN = {
    "missing": (lambda d: _rewrite(d / "model.safetensors", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
                r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"),
    "extra": (lambda d: _rewrite(d / "model.safetensors", lambda sd: sd.update({"model.layers.2.mlp.up_proj.weight": torch.ones(2)})),  # noqa: E501
              r"model\.safetensors holds tensor model\.layers\.2\.mlp\.up_proj\.weight, which the model .* has no place"),
    "shape": (lambda d: _rewrite(d / "model.safetensors", lambda sd: sd.update({"model.norm.weight": torch.ones(31)})),
              r"tensor model\.norm\.weight in model\.safetensors has shape \(31,\); the model .* has \(32,\)"),
    "truncated": (lambda d: _truncate(d / "model.safetensors", 100),
                  r"model\.safetensors is truncated \(\d+ bytes; its header describes \d+\)"),
    "cut_header": (lambda d: _truncate(d / "model.safetensors", 10**6), r"model\.safetensors is truncated or not a safetensors file"),  # noqa: E501
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), r"no model\.safetensors or model\.safetensors\.index\.json there"),  # noqa: E501
}  # fmt: skip


def _truncate(path: Path, cut: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: max(4, len(data) - cut)])


def test_every_directory_saved_here_passes_the_checks(pretrained: dict) -> None:
    """A tied directory with lm_head.weight and an inv_freq, and a sharded one, fit."""
    for directory, _ in pretrained.values():
        _check(directory)


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_directory_that_does_not_fit_is_one_line(pretrained: dict, tmp_path: Path, case: str) -> None:
    source = pretrained["untied"][0]
    directory = tmp_path / "model"
    directory.mkdir()
    for f in source.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    _check(directory)  # as saved: it fits
    breaks, line = BROKEN[case]
    breaks(directory)
    with pytest.raises(ConfigError, match=line) as e:
        _check(directory)
    assert "\n" not in str(e.value) and f"model.pretrained={directory}" in str(e.value)


def test_an_index_naming_a_missing_or_wrong_file_is_one_line(pretrained: dict, tmp_path: Path) -> None:
    source = pretrained["tied_sharded"][0]
    directory = tmp_path / "model"
    directory.mkdir()
    for f in source.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    _check(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    parts = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == parts[0])
    index["weight_map"][key] = parts[1]  # a file that does not hold it
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=f"names {parts[1]} for {key}, which it does not hold"):
        _check(directory)
    (directory / parts[1]).unlink()
    with pytest.raises(ConfigError, match=f"model.safetensors.index.json names {parts[1]}, which is not there"):
        _check(directory)


def test_a_header_is_read_not_the_tensors(pretrained: dict, tmp_path: Path) -> None:
    """The checks read a file's first 8 + n bytes: a file whose tensor bytes are all zero
    (the header intact) passes them."""
    from composerun.checkpoint.hf_import import read_header

    path = pretrained["untied"][0] / "model.safetensors"
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    blank = tmp_path / "model.safetensors"
    blank.write_bytes(data[: 8 + n] + bytes(len(data) - 8 - n))
    assert read_header(blank, "x") == {k: tuple(v.shape) for k, v in load_file(str(path)).items()}


def test_init_from_and_pretrained_together_is_one_line(pretrained: dict, tmp_path: Path) -> None:
    from composerun.checkpoint.hf_import import check_sources

    check_sources(None, "DIR")
    with pytest.raises(ConfigError, match=r"checkpoint\.init_from=x\.safetensors and model\.pretrained=DIR both give"):
        check_sources("x.safetensors", "DIR")


def _not_llama(directory: Path) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (directory / "config.json").write_text(json.dumps(cfg))


# As typed: the checks of a directory's files (a truncated file, a missing tensor and the rest
# of BROKEN) are test_a_directory_that_does_not_fit_is_one_line's; these two are checked only here.
REFUSED = {
    "not llama": (_not_llama, "config.json is for MistralForCausalLM"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json there"),
}


EXPORTED = ["mesh=2", "sharding=fsdp_blocks", "train.steps=0", "checkpoint.export=hf"]


@pytest.fixture(scope="module")
def typed(pretrained: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """The commands here, as typed, one after another, each in a child of one fork process
    (scripts/one_process.py: the console script's function with the command's argv, directory
    and environment, less the seconds of importing composerun again for each): each REFUSED
    case's command (they fail their checks before any rank starts), and the export of the
    sharded directory (test_the_command_loads_a_directory_and_exports_it_unchanged's).
    {name: (its CompletedProcess, the run directory it names)}."""
    from one_process import Forks

    root = tmp_path_factory.mktemp("typed")
    commands = {}
    for i, (case, (breaks, _)) in enumerate(REFUSED.items()):
        cwd = root / f"case{i}"
        directory = cwd / "model"
        directory.mkdir(parents=True)
        for f in pretrained["untied"][0].iterdir():
            (directory / f.name).write_bytes(f.read_bytes())
        breaks(directory)
        commands[case] = (["+model=llama3", f"model.pretrained={directory}", f"model.seq_len={SEQ}", "mesh=2"], cwd)
    commands["export"] = (["+model=llama3", f"model.pretrained={pretrained['tied_sharded'][0]}", f"model.seq_len={SEQ}",
                           *EXPORTED], root / "export")  # fmt: skip
    forks = Forks()
    out = {}
    try:
        for name, (args, cwd) in commands.items():
            cwd.mkdir(exist_ok=True)
            args = [*args, f"hydra.run.dir={cwd / 'run'}"]
            env = {**os.environ, "PYTHONWARNINGS": "ignore"}
            code = forks.start("composerun", args, cwd, env, cwd / "stdout.txt", cwd / "stderr.txt").wait(patience(300))
            proc = subprocess.CompletedProcess(
                ["composerun", *args], code, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text()
            )
            out[name] = (proc, cwd / "run")
    finally:
        forks.close()
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(REFUSED))
def test_the_command_refuses_a_directory_before_any_rank(typed: dict, case: str) -> None:
    """As a user types it: exit 2, one line naming the file or tensor, no run directory written."""
    r, run_dir = typed[case]
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and REFUSED[case][1] in lines[0], r.stderr
    assert not run_dir.exists()


def test_rows_are_read_into_a_shard_or_a_buffer_cast(tmp_path: Path) -> None:
    """Rows of the model's dtype go straight into a contiguous host shard; of another dtype
    (a bf16 file, an fp32 model) into a buffer of their size, which the caller casts."""
    from composerun.checkpoint.hf_import import RowReader

    want = {"model.a": torch.randn(6, 4).bfloat16(), "model.b": torch.randn(6, 4), "model.c": torch.randn(3)}
    save_file(want, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reader = RowReader(tmp_path)
    dest = torch.zeros(2, 4)
    assert reader.read_into("model.b", (2, 4), dest) and torch.equal(dest, want["model.b"][2:4])
    assert not reader.read_into("model.a", (2, 4), dest) and torch.equal(dest, want["model.b"][2:4])
    assert not reader.read_into("model.b", (0, 2), torch.zeros(4, 2).t())  # not contiguous
    assert torch.equal(reader.read("model.a", (3, 6)), want["model.a"][3:6])
    assert all(torch.equal(reader.read(k), v) for k, v in want.items())
    reader.close()


@pytest.mark.e2e
def test_the_command_loads_a_directory_and_exports_it_unchanged(pretrained: dict, typed: dict, tmp_path: Path) -> None:
    """`composerun +model=llama3 model.pretrained=DIR train.steps=0 checkpoint.export=hf` on
    2 ranks (the launcher's checks pass, each rank loads its rows, nothing trains): the
    exported tensors are DIR's, bit for bit, a sharded DIR included.  The command as typed for
    the sharded DIR (several files and an index); the single-file DIR through the launcher the
    command calls (launch/agent.py's `launch`), with the config it composes."""
    for name in ("untied", "tied_sharded"):
        directory, _ = pretrained[name]
        run_dir = tmp_path / name
        if name == "tied_sharded":  # (the command ran in the typed fixture)
            r, run_dir = typed["export"]
            assert r.returncode == 0, r.stderr[-2000:]
        else:
            cfg = pretrained_config(directory, *EXPORTED, "launch.start_method=forkserver", "metrics.progress=false")
            run_dir.mkdir()
            assert launch(cfg, run_dir, 2, choose_start(cfg, run_dir))["status"] == "ok"
        got, want = file_tensors(run_dir / "export" / "hf"), file_tensors(directory)
        assert sorted(got) == sorted(want), name
        assert all(torch.equal(got[k], want[k]) for k in want), name


@pytest.mark.distributed
def test_a_resumed_run_does_not_read_the_directory_again(pretrained: dict, tmp_path: Path) -> None:
    """The checkpoint's weights replace the pretrained ones, so a run that resumes one does not
    read DIR's weights (only its config.json and headers): rank 0's log says so once, for the
    first run."""
    directory, _ = pretrained["untied"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for steps in (2, 3):
        cfg = pretrained_config(directory, f"train.steps={steps}", "metrics.progress=false")
        summary = launch(cfg, run_dir, 1, choose_start(cfg, run_dir))
    assert summary["status"] == "ok" and read_metrics(run_dir)[-1]["step"] == 3
    log = (run_dir / "rank0.log").read_text()
    assert "resumed from" in log
    assert log.count("model.pretrained: the initial weights are") == 1, log
