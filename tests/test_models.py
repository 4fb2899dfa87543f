"""Pure tier: the models composerun ships, built directly and from their configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.testing._internal.common_dist_composable as torch_composable
import torch.testing._internal.distributed.common_state_dict as torch_state_dict
from conftest import REPO, compose

from composerun.config.schema import ModelConfig, Task
from composerun.data import SyntheticData
from composerun.errors import ConfigError
from composerun.models import build_model, reference
from composerun.models.transformer import Transformer
from composerun.train.optim import build_optimizer

COMPOSABLE = ["UnitModule", "CompositeModel", "UnitParamModule", "CompositeParamModel", "NestedSequentialModel"]
FUSION = ["FusionEmbedding", "FusionEmbeddingWithHook", "FusionEmbeddingWithModifier"]
MODEL_CONFIGS = sorted(p.stem for p in (REPO / "composerun" / "configs" / "model").glob("*.yaml") if not p.stem.startswith("_"))
# Options too big to build whole here (their published shapes: tests/test_llama.py, on the meta
# device) run at a small width and depth, keeping the rest of the preset (rope scaling, tying);
# llama3 and hf take their shape from a Hugging Face directory (tests/test_hf.py, tests/test_hf_any.py).
SMALL = ("model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=300", "model.seq_len=16",
         "model.kwargs.n_kv_heads=2", "model.kwargs.ffn_dim=128")  # fmt: skip
OVERRIDES = {"llama3_1b": SMALL, "llama3_3b": SMALL, "llama3_8b": SMALL}
NEEDS_A_DIRECTORY = ("llama3", "hf")


def _pair(name: str) -> tuple[nn.Module, nn.Module]:
    """(composerun's model, torch's test model) at torch's default sizes."""
    if name in FUSION:
        ours = getattr(reference, name)(vocab_size=5, fusion_vocab_size=3, dim=6)
        theirs = getattr(torch_state_dict, name)(vocab_size=5, fusion_vocab_size=3, embed_dim=6)
        return ours, theirs
    return getattr(reference, name)(), getattr(torch_composable, name)(torch.device("cpu"))


def _shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}


def _model_and_data(name: str, *overrides: str):
    cfg = compose(f"+model={name}", *overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    data = SyntheticData(cfg.model, seed=cfg.data.seed)
    return cfg, model, data


@pytest.mark.parametrize("name", COMPOSABLE + FUSION)
def test_state_dict_matches_torch_reference_model(name):
    """A composerun reference model has exactly torch's state-dict keys and shapes."""
    ours, theirs = _pair(name)
    assert _shapes(ours.state_dict()) == _shapes(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())  # same order, too


@pytest.mark.parametrize("name", COMPOSABLE + FUSION)
def test_torch_state_dict_loads_into_reference_model(name):
    """A state dict saved from torch's test model loads strictly into composerun's, values intact."""
    ours, theirs = _pair(name)
    ours.load_state_dict(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_width_is_configurable():
    """`dim` sets the width of every square weight, buffer and parameter."""
    for key, shape in _shapes(reference.CompositeModel(dim=8).state_dict()).items():
        assert shape == ((8, 8) if key.endswith("weight") else (8,)), key
    assert reference.UnitParamModule(dim=8).p.shape == (8, 8)
    assert reference.CompositeParamModel(dim=8).buffer.shape == (8, 8)
    _, model, _ = _model_and_data("composite", "model.dim=8")
    assert model.l1.weight.shape == (8, 8) and model.u2.seq[1].weight.shape == (8, 8)


@pytest.mark.parametrize("name", [n for n in MODEL_CONFIGS if n not in NEEDS_A_DIRECTORY])
def test_shipped_model_forward_and_loss(name):
    """Every shipped model trains on its data: output fits the targets, loss is a finite scalar with gradients."""
    cfg, model, data = _model_and_data(name, *OVERRIDES.get(name, ()))
    x, y = data.batch(range(4))
    out = model(x)
    loss = data.loss(out, y)
    if cfg.model.task == Task.regression:
        assert out.shape == y.shape
        assert torch.allclose(loss, F.mse_loss(out, y))
    else:
        vocab = (cfg.model.vocab_size or 0) + (cfg.model.fusion_vocab_size or 0)
        assert y.dtype == torch.long and out.shape == (*x.shape, vocab)
        assert torch.allclose(loss, F.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_one_optimizer_step_lowers_loss(optim):
    """One step of the configured optimizer lowers the composite model's loss on the same batch."""
    cfg, model, data = _model_and_data("composite", f"optim={optim}", "model.dim=16")
    opt = build_optimizer(model, cfg.optim)
    x, y = data.batch(range(8))
    before = data.loss(model(x), y)
    before.backward()
    opt.step()
    with torch.no_grad():
        after = data.loss(model(x), y)
    assert after < before


def test_fusion_embedding_with_hook_renames_and_round_trips():
    """FusionEmbeddingWithHook saves `embedding.weight` as `weight` and loads it back, also nested."""
    src = reference.FusionEmbeddingWithHook(vocab_size=4, fusion_vocab_size=3, dim=5)
    sd = src.state_dict()
    assert set(sd) == {"weight", "fusion_embedding.weight"}
    dst = reference.FusionEmbeddingWithHook(vocab_size=4, fusion_vocab_size=3, dim=5)
    dst.load_state_dict(sd)
    assert torch.equal(dst.embedding.weight, src.embedding.weight)
    assert torch.equal(dst.fusion_embedding.weight, src.fusion_embedding.weight)

    outer_src, outer_dst = nn.Sequential(src), nn.Sequential(dst)
    nn.init.zeros_(dst.embedding.weight)
    assert set(outer_src.state_dict()) == {"0.weight", "0.fusion_embedding.weight"}
    outer_dst.load_state_dict(outer_src.state_dict())
    assert torch.equal(dst.embedding.weight, src.embedding.weight)


def test_fusion_embedding_with_modifier_declares_torch_fqn_mapping():
    """FusionEmbeddingWithModifier maps `weight` back to `embedding`, as torch's state-dict utilities expect."""
    ours, theirs = _pair("FusionEmbeddingWithModifier")
    assert ours._fqn_modifiers() == theirs._fqn_modifiers() == {"weight": "embedding"}


def test_transformer_fqns_and_output_shape():
    """The transformer has FQNs tok_emb, blocks.N..., norm, head, and returns (B, T, vocab) logits."""
    model = Transformer(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=8)
    keys = list(model.state_dict())
    assert {k.split(".")[0] for k in keys} == {"tok_emb", "pos_emb", "blocks", "norm", "head"}
    assert {k.split(".")[1] for k in keys if k.startswith("blocks.")} == {"0", "1", "2"}
    block_keys = [[k.split(".", 2)[2] for k in keys if k.startswith(f"blocks.{i}.")] for i in range(3)]
    assert block_keys[0] == block_keys[1] == block_keys[2]
    # queries, keys and values have projections of their own: tensor parallelism splits each by heads
    assert {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.proj.weight"} <= set(block_keys[0])
    assert model.head.weight.shape == (32, 16) and model.tok_emb.weight.shape == (32, 16)
    tokens = torch.randint(32, (2, 7))
    assert model(tokens).shape == (2, 7, 32)


def test_transformer_from_config_has_configured_sizes():
    """`+model=transformer` builds the configured number of blocks, width and vocab."""
    cfg, model, data = _model_and_data("transformer", "model.n_layers=2", "model.dim=32")
    assert len(model.blocks) == 2 and model.tok_emb.weight.shape == (cfg.model.vocab_size, 32)
    assert model.pos_emb.num_embeddings >= cfg.model.seq_len


def test_build_model_rejects_bad_target():
    """A model._target_ that cannot be imported, or built, is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=r"model\._target_"):
        build_model(ModelConfig(_target_="composerun.models.reference.NoSuchModel"))
    with pytest.raises(ConfigError, match=r"model\._target_"):
        build_model(ModelConfig(_target_="composerun.models.transformer.Transformer", dim=10, n_heads=3))


def test_the_command_line_names_the_hf_model_class_as_it_is() -> None:
    """models/hf.py names +model=hf's class without importing it (the command line answers a
    config error without torch): the name must be the class's."""
    from composerun.models import hf, hf_causal

    assert hf.HF_CAUSAL == hf_causal.HF_TARGET == f"{hf_causal.HFCausalLM.__module__}.HFCausalLM"
    assert "_target_: " + hf.HF_CAUSAL in (REPO / "composerun" / "configs" / "model" / "hf.yaml").read_text()


def test_model_hf_without_transformers_says_to_install_the_extra(monkeypatch, tmp_path) -> None:
    """A plain install has no transformers: +model=hf says so in one line naming the extra."""
    import pytest

    from composerun.errors import ConfigError
    from composerun.models import hf_causal

    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ConfigError, match=r"^\+model=hf needs transformers.*pip install 'composerun\[hf\]'$"):
        hf_causal.read_config(tmp_path)
