"""Hugging Face checkpoints out: `checkpoint.export=hf` and `composerun-ckpt export --format hf`.

Three runs of a 2-block llama3_debug serve the tests: mesh 2 (fsdp_blocks, untied), mesh 2x2
(hsdp_blocks, tied embeddings, a maximum file size that splits the export into several files
and an index), and one from a pretrained directory saved by transformers (its config's other
keys, generation_config.json, a tokenizer).  transformers' own `from_pretrained` loads each
export, and its logits are compared with composerun's model holding the run's last DCP
checkpoint.  A transformers model with Llama 3.1's rope scaling, imported and exported
untrained, is compared with that source model itself.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import choose_start, cli, compose, compose_node, latest_checkpoint, train
from safetensors import safe_open

from composerun.checkpoint import hf_export
from composerun.checkpoint.cli import main
from composerun.config import to_typed
from composerun.config import validate as validate_config
from composerun.errors import CheckpointError
from composerun.models import build_model
from composerun.models.hf import apply_pretrained, hf_name

transformers = pytest.importorskip("transformers")

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "composerun" / "assets" / "tokenizer"
LLAMA = ["+model=llama3_debug", "model.n_layers=2", "data=tokens", "train.steps=2", "checkpoint.export=hf"]
RUNS = {
    "mesh2": [*LLAMA, "mesh=2", "sharding=fsdp_blocks"],
    "mesh2x2_tied": [*LLAMA, "mesh=2x2", "sharding=hsdp_blocks", "model.kwargs.tie_embeddings=true"],
    # tensor parallel: columns of o_proj/down_proj split over tp, rows over FSDP, written as one tensor each
    "mesh2x2_tp": [*LLAMA, "mesh=2x2", "sharding=fsdp_tp"],
}
SMALL_FILES = 300_000  # bytes: the 2x2 run's export (2.6 MB) in several files


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_export")
    train(root / "mesh2", *RUNS["mesh2"])
    # (ranks forked from this process once hung in a DCP save: a lock another thread of the test
    # process held at the fork, in the child's unpickling; the file size is a config key instead)
    small = f"checkpoint.export_max_shard_size={SMALL_FILES}"
    train(root / "mesh2x2_tied", *RUNS["mesh2x2_tied"], small, "launch.omp_threads=1")
    train(root / "mesh2x2_tp", *RUNS["mesh2x2_tp"], "launch.omp_threads=1")
    return {name: root / name for name in RUNS}


def stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files, checking their metadata."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            assert st.metadata() == {"format": "pt"}, f
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def model_config(*overrides: str):
    """The model config the ranks get (model.pretrained's dimensions filled in, as launch/job.py does)."""
    node = compose_node(*overrides, validate=False)
    apply_pretrained(node)
    validate_config(node)
    return to_typed(node).model


def checkpoint_weights(run_dir: Path, mcfg) -> dict[str, torch.Tensor]:
    """The run's last checkpoint in the plain model, loaded by DCP with no process group."""
    import torch.distributed.checkpoint as dcp

    sd = build_model(mcfg).state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": sd}, checkpoint_id=str(latest_checkpoint(run_dir)))
    return sd


def check_loads_with_same_logits(export: Path, run_dir: Path, overrides: list[str]) -> None:
    """transformers loads `export` with no key missing or left over, and its logits are
    composerun's Llama's, holding the run's last checkpoint, within 1e-5; every exported tensor
    is that checkpoint's, under its Hugging Face name."""
    mcfg = model_config(*overrides)
    weights = checkpoint_weights(run_dir, mcfg)
    files = stored(export)
    assert sorted(files) == sorted(hf_name(k) for k in weights)
    for key, t in weights.items():
        assert torch.equal(files[hf_name(key)], t), key
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = build_model(mcfg)
    ours.load_state_dict(weights)
    tokens = torch.randint(0, ours.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_run_exports_a_directory_transformers_loads(runs: dict[str, Path], name: str) -> None:
    """RUN/export/hf is a Hugging Face directory (config.json, safetensors with format: pt,
    the shipped shards' tokenizer) that transformers loads unchanged, with composerun's
    logits; nothing of its writing is left beside it."""
    export = runs[name] / "export" / "hf"
    check_loads_with_same_logits(export, runs[name], RUNS[name])
    assert sorted(p.name for p in export.parent.iterdir()) == ["hf"]
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    # the shipped tokenizer's <|begin_of_text|> and <|end_of_text|>: generate() stops at the end
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (export / f).read_bytes() == (SHIPPED_TOKENIZER / f).read_bytes(), f
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert summary["export"] == str(export)


@pytest.mark.distributed
def test_a_tied_model_writes_no_lm_head_and_transformers_ties_it(runs: dict[str, Path]) -> None:
    export = runs["mesh2x2_tied"] / "export" / "hf"
    assert "lm_head.weight" not in stored(export)
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


@pytest.mark.distributed
def test_a_large_export_is_split_with_an_index(runs: dict[str, Path]) -> None:
    """Past the maximum file size the ranks write several files, each within it (but for a
    tensor larger than it), named as save_pretrained names them, and an index of every tensor."""
    export = runs["mesh2x2_tied"] / "export" / "hf"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in export.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    tensors = stored(export)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for f in files:
        with safe_open(str(export / f), framework="pt") as st:
            sizes = [st.get_tensor(k).numel() * 4 for k in st.keys()]
            assert sum(sizes) <= SMALL_FILES or len(sizes) == 1, (f, sizes)
            assert all(index["weight_map"][k] == f for k in st.keys())


@pytest.mark.e2e
def test_ckpt_cli_exports_a_checkpoint_in_several_files(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`composerun-ckpt export RUN --format hf OUT --max-shard-size 1MB`: the run's config from
    the checkpoint's manifest, the tensors a batch at a time, several files and an index;
    transformers loads it with the run's logits."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(runs["mesh2"]), "--format", "hf", str(out), "--max-shard-size", "1MB"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert "model-00001-of-0000" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) >= 3
    assert not out.with_name("out.tmp").exists()
    check_loads_with_same_logits(out, runs["mesh2"], RUNS["mesh2"])
    assert (out / "tokenizer.json").read_bytes() == (SHIPPED_TOKENIZER / "tokenizer.json").read_bytes()
    ours = json.loads((runs["mesh2"] / "export" / "hf" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == ours


def tiny_pretrained(directory: Path) -> None:
    """A random LlamaForCausalLM as transformers saves it, with a generation config, token ids
    of its own, a config that says bfloat16, and a tokenizer (the shipped one, with a setting
    of its own)."""
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=3,
        eos_token_id=4,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    transformers.GenerationConfig(bos_token_id=3, eos_token_id=4, max_new_tokens=17).save_pretrained(directory)
    saved = json.loads((directory / "config.json").read_text())  # as a bfloat16 model's reads (transformers 5)
    (directory / "config.json").write_text(json.dumps({**saved, "dtype": "bfloat16"}))
    for f in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copyfile(SHIPPED_TOKENIZER / f, directory / f)
    tok_config = json.loads((SHIPPED_TOKENIZER / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tok_config, "model_max_length": 128}))


@pytest.mark.e2e
def test_a_pretrained_run_exports_its_config_generation_config_and_tokenizer(tmp_path: Path) -> None:
    """From model.pretrained: config.json keeps the source's token ids, generation_config.json
    and the directory's tokenizer (not the shards' recorded one) are copied; AutoTokenizer
    loads the export's and tokenizes as the shipped tokenizer does."""
    source = tmp_path / "pretrained"
    tiny_pretrained(source)
    overrides = ["+model=llama3", f"model.pretrained={source}", "model.seq_len=32", "data=tokens", "train.steps=1"]
    r = cli(*overrides, "checkpoint.export=hf", "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir = tmp_path / "run"
    export = run_dir / "export" / "hf"
    config = json.loads((export / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (3, 4, 2)
    assert config["hidden_size"] == 64 and config["intermediate_size"] == 96
    assert config["dtype"] == "float32", "the run's weights are float32, whatever the source's were"
    gen = json.loads((export / "generation_config.json").read_text())
    assert gen == json.loads((source / "generation_config.json").read_text()) and gen["max_new_tokens"] == 17
    assert json.loads((export / "tokenizer_config.json").read_text())["model_max_length"] == 128
    tok = transformers.AutoTokenizer.from_pretrained(export)
    text = "To be, or not to be: that is the question."
    from tokenizers import Tokenizer

    assert tok(text)["input_ids"] == Tokenizer.from_file(str(SHIPPED_TOKENIZER / "tokenizer.json")).encode(text).ids
    check_loads_with_same_logits(export, run_dir, overrides)


@pytest.mark.distributed
def test_an_export_with_llama3_rope_scaling_has_the_sources_logits(tmp_path: Path) -> None:
    """A transformers Llama with Llama 3.1's rope scaling (original_max_position_embeddings 8),
    imported on mesh 2 and exported without training: transformers loads the export with the
    rope settings it was saved with, and its logits of 48 tokens (positions 8-47 past the
    original length) are the source model's within 1e-5."""
    from composerun.launch.agent import launch

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip
    source = tmp_path / "pretrained"
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_parameters=rope,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(source)
    overrides = ["+model=llama3", f"model.pretrained={source}", "model.seq_len=48", "data=tokens", "train.steps=0",
                 "checkpoint.export=hf", "mesh=2", "sharding=fsdp_blocks", "launch.start_method=forkserver",
                 "metrics.progress=false"]  # fmt: skip
    node = compose_node(*overrides, validate=False)
    apply_pretrained(node)
    validate_config(node)
    cfg, run_dir = to_typed(node), tmp_path / "run"
    summary = launch(cfg, run_dir, 2, choose_start(cfg, run_dir))
    assert summary["status"] == "ok", summary
    export = tmp_path / "run" / "export" / "hf"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(tokens).logits, loaded(tokens).logits
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"the export's logits differ from the source's by {diff:.3g}"
    assert {k: loaded.config.rope_parameters.get(k) for k in rope} == rope


# checkpoint.export=hf of a model that is not composerun's Llama: one line, exit 2, before any
# rank starts, nothing written: the catalog's c40 (scripts/bad_inputs.py).


@pytest.mark.e2e
def test_ckpt_cli_refuses_a_model_with_no_hugging_face_equivalent(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose manifest's model is not a Llama: one line, exit 2, no directory."""
    ckpt = tmp_path / "step"
    shutil.copytree(latest_checkpoint(runs["mesh2"]), ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["config"]["model"]["_target_"] = "composerun.models.tiny.Tiny"
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(ckpt), "--format", "hf", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no Hugging Face equivalent" in err and len(err.splitlines()) == 1, err
    assert "error: --format hf: " in err and "use --format safetensors" in err and "checkpoint.export" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]


def test_ckpt_cli_never_replaces_a_directory_holding_other_files(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT holding anything an export does not write (a user's notes, a run's checkpoints) is
    refused, one line, exit 2, untouched; an earlier export there is replaced."""
    ckpt = latest_checkpoint(runs["mesh2"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(ckpt), "--format", "hf", str(mine)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "not a Hugging Face export" in err and len(err.splitlines()) == 1, err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    again = tmp_path / "again"
    for _ in range(2):  # the second replaces the first's export
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(ckpt), "--format", "hf", str(again)])
        assert exit_info.value.code == 0
    assert (again / "config.json").is_file()


def test_a_failed_export_leaves_nothing_that_looks_complete(tmp_path: Path, mesh, monkeypatch) -> None:
    """A write that fails half-way (a full disk): CheckpointError on every rank, and neither
    the directory nor its temporary is left; the safetensors export leaves no `.tmp` either."""
    from composerun.checkpoint import export

    cfg = compose("+model=llama3_debug", "model.n_layers=1", "data=tokens", "checkpoint.export=hf")
    model = build_model(cfg.model)
    calls = []

    def full_disk(fd: int, t: torch.Tensor, at: int) -> int:
        calls.append(at)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return 0

    monkeypatch.setattr(export, "write_at", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        hf_export.export_hf(model, cfg, tmp_path / "export" / "hf", max_shard_size=200_000)
    assert len(calls) > 3 and list((tmp_path / "export").iterdir()) == []
    with pytest.raises(CheckpointError, match="No space left on device"):
        export.export_safetensors(model, tmp_path / "export" / "model.safetensors")
    assert list((tmp_path / "export").iterdir()) == []


def test_ckpt_cli_failed_export_leaves_nothing(tmp_path: Path) -> None:
    """The command line's export failing in its last file: no OUT, no OUT.tmp."""
    cfg = compose("+model=llama3_debug", "model.n_layers=1")
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in build_model(cfg.model).state_dict().items()}
    seen = []

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        seen.extend(keys)
        if len(seen) == len(specs):
            raise CheckpointError("the checkpoint's last file is truncated")
        return {k: torch.zeros(specs[k][1], dtype=specs[k][0]) for k in keys}

    with pytest.raises(CheckpointError):
        hf_export.export_checkpoint(cfg, specs, load, tmp_path / "out", max_shard_size=100_000)
    assert sorted(seen) == sorted(specs) and list(tmp_path.iterdir()) == []


def test_shard_plan_cuts_in_order_within_the_size() -> None:
    f32 = torch.float32
    specs = {"a": (f32, (10,)), "b": (f32, (10,)), "big": (f32, (100,)), "c": (f32, (5,)), "d": (f32, (5,))}
    plan = hf_export.shard_plan(specs, 80)
    assert plan == {
        "model-00001-of-00003.safetensors": ["a", "b"],
        "model-00002-of-00003.safetensors": ["big"],  # larger than the size: a file of its own
        "model-00003-of-00003.safetensors": ["c", "d"],
    }
    assert hf_export.shard_plan(specs, 10**9) == {"model.safetensors": list(specs)}
