"""Tensor parallelism of a transformers causal LM (`+model=hf` under sharding=tp or fsdp_tp):
transformers' own plan for the model, in parallel/styles.py's vocabulary.

transformers' plan is the model's `tp_plan` (a dict property: the causal LM class's `_tp_plan`,
`lm_head`, merged with the config's `base_model_tp_plan` under the base model's prefix, and the
input embedding `embed_tokens` split by vocabulary rows).  Its keys name modules with `*` for a
layer's index; its layout is Megatron's without sequence parallelism: the activations between
two blocks are whole on every tp rank.  Its style names map onto composerun's styles as:

    colwise                         colwise (input whole, output this rank's features)
    rowwise                         rowwise (input this rank's features, output summed whole)
    colwise_gather_output           colwise, output gathered whole (a packed qkv_proj or
                                    gate_up_proj, whose parts a split of its output would mix)
    rowwise_split_input             rowwise, input whole (each rank takes its features)
    embedding_rowwise               rowwise (the table split by vocabulary rows, output summed)
    replicated_with_grad_allreduce  sequence over dim -2, output local: a per-head norm
                                    (q_norm, k_norm) run on this rank's heads, its weight a
                                    replicated DTensor, so that its gradient, each rank's from
                                    its own heads, is summed over tp

and `lm_head` under a rule with `loss_parallel` is colwise with its output left split over
the vocabulary (a DTensor the loss takes as it is).  Any other style (a mixture of experts'
`packed_colwise`, `moe_tp_experts`, ...) is refused in one line naming it and the module.

A rule on a decoder layer takes the plan's entries inside it; the rule on the root takes those
outside every layer list (`embed_tokens`, `lm_head`).  Tied embeddings (one table, the input
embedding and the output head) stay whole: split for one use, the other would read a different
tensor.  They are then replicated over tp (FSDP shards them with the root), the logits are
whole and the loss is not vocabulary-parallel; the plan table says so.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from composerun.errors import ConfigError

# transformers' style -> composerun's (parallel/styles.py)
STYLES: dict[str, Any] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": {"style": "colwise", "output_layouts": "replicate"},
    "rowwise_split_input": {"style": "rowwise", "input_layouts": "replicate"},
    "embedding_rowwise": {"style": "rowwise", "input_layouts": "replicate"},  # (torch's default: ids split)
    "replicated_with_grad_allreduce": {"style": "sequence", "sequence_dim": -2, "use_local_output": True},
}
HEAD = "lm_head"
VOCAB_SPLIT = {"style": "colwise", "output_layouts": "shard(-1)", "use_local_output": False}


def is_transformers(module: nn.Module) -> bool:
    """Whether `module` is one of transformers' (a `+model=hf` model or a part of it)."""
    return type(module).__module__.startswith("transformers.")


def generic(name: str) -> str:
    """A module's name as transformers' plan keys spell it: each layer index a `*`."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def hf_styles(root: nn.Module, fqn: str, loss_parallel: bool, tp: int | None, where: str) -> dict[str, Any]:
    """For a `parallelize` rule without a style map on module `fqn` of transformers' model
    `root`: {"styles": {relative name: style}, "loss_parallel": whether the module's output is
    vocabulary-split logits, "unsplit": {relative name: why it stays whole}} (no "unsplit"
    where nothing does).  ConfigError in one line for what composerun cannot split."""
    from composerun.models.hf_causal import text_config

    plan = getattr(root, "tp_plan", None)  # (transformers' merged plan, keys relative to the root)
    module = root.get_submodule(fqn)
    if not isinstance(plan, dict) or not getattr(text_config(root.config), "base_model_tp_plan", None):
        raise ConfigError(
            f"{where}: {type(root).__name__} has no tensor-parallel plan in transformers (its config's "
            "base_model_tp_plan is empty): use a policy without tp (sharding=fsdp_blocks), or give the rule a "
            "style map (styles: {submodule: colwise, ...})"
        )
    tied = shared_parameters(root)
    styles: dict[str, Any] = {}
    unsplit: dict[str, str] = {}
    lp = False
    for sub, m in module.named_modules():
        if not sub:
            continue
        name = f"{fqn}.{sub}" if fqn else sub
        key = generic(name)
        if key not in plan or (not fqn and "*" in key):  # (the root leaves the layers to their rules)
            continue
        if any(id(p) in tied for p in m.parameters(recurse=False)):
            unsplit[sub] = (
                "tied embeddings (one table, the input's and the output's), replicated over tp, no loss parallel"
            )
            continue
        style = plan[key]
        odd = style == "replicated_with_grad_allreduce" and not _per_head(root, m)
        if style not in STYLES or odd:
            what = " on a module that is not a per-head norm (a weight head_dim long)" if odd else ""
            raise ConfigError(
                f"{where}: {name} has transformers' tensor-parallel style {style!r}, which composerun does not map"
                f"{what} (it maps {', '.join(STYLES)}): use a policy without tp (sharding=fsdp_blocks), or give "
                "the rule a style map"
            )
        spec = STYLES[style]
        if name == HEAD and loss_parallel:
            spec, lp = VOCAB_SPLIT, True
        if tp:
            _check_split(m, name, style, tp, where)
        styles[sub] = spec
    if tp and styles and fqn:
        _check_heads(root, tp, where)
    return {"styles": styles, "loss_parallel": lp, **({"unsplit": unsplit} if unsplit else {})}


def shared_parameters(root: nn.Module) -> set[int]:
    """The ids of the parameters that two modules of `root` share (tied embeddings)."""
    count: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    return {i for i, n in count.items() if n > 1}


def _head_dim(root: nn.Module) -> int:
    from composerun.models.hf_causal import text_config

    config = text_config(root.config)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _per_head(root: nn.Module, m: nn.Module) -> bool:
    """Whether `m` is a norm of one head's features (its weight head_dim long), so that the
    heads dim (-2) of its input is the one colwise q/k/v projections split."""
    weight = getattr(m, "weight", None)
    return weight is not None and weight.dim() == 1 and weight.shape[0] == _head_dim(root)


def _check_split(m: nn.Module, name: str, style: str, tp: int, where: str) -> None:
    """The dim a style splits divides evenly over the tp ranks."""
    if isinstance(m, nn.Embedding):
        what, n = "rows (its vocabulary)", m.num_embeddings
    elif isinstance(m, nn.Linear) and style.startswith("colwise"):
        what, n = "output features", m.out_features
    elif isinstance(m, nn.Linear) and style.startswith("rowwise"):
        what, n = "input features", m.in_features
    else:
        return
    if n % tp:
        raise ConfigError(
            f"{where}: {name} ({style}) has {n} {what}, which {tp} tensor-parallel ranks cannot split evenly: "
            f"use a tp dim that divides {n} (mesh)"
        )


def _check_heads(root: nn.Module, tp: int, where: str) -> None:
    """The attention heads and key/value heads split evenly over the tp ranks (each rank
    computes attention for whole heads of its own)."""
    from composerun.models.hf_causal import text_config

    config = text_config(root.config)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"{where}: {type(root).__name__} has {attr}={heads} (config.json), which {tp} tensor-parallel "
                f"ranks cannot split evenly: use a tp dim that divides {heads} (mesh)"
            )
