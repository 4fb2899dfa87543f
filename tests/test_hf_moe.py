"""A mixture of experts under `+model=hf`, without ranks: where transformers 5 fuses a layer's
experts into one parameter per projection while its files keep one tensor per expert and
projection, composerun reads and writes the files' own layout (models/hf_layout.py, asked of
transformers' conversion mapping).  Qwen3-MoE (also in tests/test_hf_any.py's family matrix,
on ranks) and Mixtral (whose files also rename the block), each checked against transformers
itself: what its from_pretrained loads and what its save_pretrained writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compose_node

from composerun.config import Config, to_typed
from composerun.config import validate as validate_config
from composerun.errors import ConfigError
from composerun.models.hf import apply_pretrained

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
MOE = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SIZES, head_dim=8, moe_intermediate_size=12, num_experts=4,
                                                     num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(**SIZES, intermediate_size=12, num_local_experts=4,
                                                  num_experts_per_tok=2),
}  # fmt: skip


def config(directory: Path, *overrides: str) -> Config:
    node = compose_node("+model=hf", f"model.pretrained={directory}", "model.seq_len=8", "checkpoint=none",
                        *overrides, validate=False)  # fmt: skip
    apply_pretrained(node)
    validate_config(node)
    return to_typed(node)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family, make in MOE.items():
        torch.manual_seed(0)
        out[family] = tmp_path_factory.mktemp(family)
        transformers.AutoModelForCausalLM.from_config(make()).save_pretrained(out[family])
    return out


def file_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def meta_model(cfg: Config) -> Any:
    from composerun.models import build_model

    with torch.device("meta"):
        return build_model(cfg.model)


@pytest.mark.parametrize("family", list(MOE))
def test_the_layout_names_what_save_pretrained_writes(saved: dict[str, Path], family: str) -> None:
    """The file tensors the layout names are those save_pretrained wrote (one per expert and
    projection), and each fused expert parameter is made of pieces of every one of its rows."""
    from composerun.models.hf_layout import Part, file_layout

    layout = file_layout(meta_model(config(saved[family])))
    assert layout is not None and set(layout) == file_names(saved[family])
    parts = [p for p in layout.values() if isinstance(p, Part)]
    assert {p.key.rsplit(".", 1)[-1] for p in parts} == {"gate_up_proj", "down_proj"}
    assert {p.row for p in parts} == {0, 1, 2, 3}


@pytest.mark.parametrize("family", list(MOE))
def test_the_experts_read_are_from_pretrained_s_and_written_back_as_saved(saved: dict[str, Path], family: str,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """Read through the layout (the reader the ranks use, a whole tensor and some rows of one),
    every tensor is the one transformers' from_pretrained loads, bit for bit; the command line's
    export (composerun-ckpt export --format hf, in small files) of those tensors writes the
    names save_pretrained wrote, and from_pretrained loads it as the same model."""
    from composerun.checkpoint.export import fill, model_tensors
    from composerun.checkpoint.hf_export import export_checkpoint
    from composerun.checkpoint.hf_import import LaidOut, RowReader
    from composerun.models.hf_causal import materialize
    from composerun.models.hf_layout import file_layout

    directory = saved[family]
    cfg = config(directory)
    model = meta_model(cfg)
    materialize(model, torch.device("cpu"))
    targets = model_tensors(model)
    reader = RowReader(directory)
    try:
        source = LaidOut(reader, file_layout(model), targets)
        fill(targets, source)
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
        assert set(targets) == set(ref)
        assert [k for k in ref if not torch.equal(targets[k], ref[k])] == []
        key = "model.layers.1.mlp.experts.gate_up_proj"
        assert torch.equal(source.read(key, (1, 3)), ref[key][1:3])
    finally:
        reader.close()
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in ref.items()}
    export_checkpoint(cfg, specs, lambda keys: {k: ref[k] for k in keys}, tmp_path / "out", max_shard_size=8_000)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == file_names(directory)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert [k for k in ref if not torch.equal(back[k], ref[k])] == []


def test_a_directory_missing_an_expert_is_one_line(saved: dict[str, Path], tmp_path: Path) -> None:
    """The launcher's check of the files (headers only) names the missing expert's own tensor."""
    from safetensors.torch import load_file, save_file

    from composerun.checkpoint.hf_import import check_pretrained
    from composerun.launch.preflight import model_shapes
    from composerun.models.hf_layout import file_layout

    source = saved["qwen3_moe"]
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = meta_model(config(tmp_path))
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight is missing"):
        check_pretrained(tmp_path, model_shapes(model), file_layout(model))


def test_plan_runs_the_experts_on_fake_tensors(saved: dict[str, Path]) -> None:
    """plan=true's estimate runs the mixture of experts' forward and backward on fake tensors
    (float32: transformers' grouped experts take its own fallback op there)."""
    from composerun.parallel.planner import plan_offline

    report, _ = plan_offline(config(saved["qwen3_moe"], "mesh=2", "sharding=fsdp_blocks", "plan=true"))
    assert min(report["estimate"]["peak_bytes_per_rank"]) > 0


def test_a_directory_holding_the_fused_experts_is_read_as_it_is(saved: dict[str, Path], tmp_path: Path) -> None:
    """Files that hold the experts fused, under the model's own names (as from_pretrained also
    takes them), pass the check and are read as stored."""
    from safetensors.torch import save_file

    from composerun.checkpoint.export import fill, model_tensors
    from composerun.checkpoint.hf_import import LaidOut, RowReader, check_pretrained
    from composerun.launch.preflight import model_shapes
    from composerun.models.hf_causal import materialize
    from composerun.models.hf_layout import file_layout

    ref = transformers.AutoModelForCausalLM.from_pretrained(saved["qwen3_moe"], dtype=torch.float32).state_dict()
    (tmp_path / "config.json").write_bytes((saved["qwen3_moe"] / "config.json").read_bytes())
    fused = {k: v.contiguous() for k, v in ref.items()}
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = meta_model(config(tmp_path))
    check_pretrained(tmp_path, model_shapes(model), file_layout(model))
    materialize(model, torch.device("cpu"))
    targets = model_tensors(model)
    reader = RowReader(tmp_path)
    try:
        fill(targets, LaidOut(reader, file_layout(model), targets))
    finally:
        reader.close()
    assert [k for k in ref if not torch.equal(targets[k], ref[k])] == []


def test_is_fake_tells_the_estimates_tensors_from_real_ones() -> None:
    """The contract hf_causal.py relies on to send only fake tensors to transformers' fallback."""
    from composerun import _torch_compat as compat

    with compat.fake_tensor_mode():
        fake = torch.empty(2, 3)
    assert compat.is_fake(fake) and not compat.is_fake(torch.empty(2, 3))
    assert not compat.is_fake(torch.empty(2, 3, device="meta"))


def test_a_conversion_composerun_does_not_take_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose files transformers converts otherwise than by stacking the experts and
    concatenating their projections (here: a transpose as well) is refused when the model is
    built, naming the tensor and the operations."""
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    from composerun.models.hf_layout import layout_of

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(MOE["qwen3_moe"]())
    odd = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj",
                          operations=[MergeModulelist(dim=0), Transpose(1, 2)])  # fmt: skip
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda *a, **k: [odd])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"builds its tensor model\.layers\.0\.mlp\.experts\.down_proj from its files by "
                                          r"MergeModulelist, Transpose; composerun reads only"):  # fmt: skip
        layout_of(model, shapes)
