"""Tensor and sequence parallelism as config: a rule's style map, checked against the model
and turned into torch's `parallelize_module` plan over the mesh dim `tp`.

A style map is {submodule FQN glob (relative to the matched module): style}.  A style is a
name, `colwise` / `rowwise` (a Linear's or Embedding's weight split by output / input
features: torch's ColwiseParallel / RowwiseParallel) or `sequence` (a norm run on the
sequence-sharded activations: SequenceParallel), or a dict with `style` (those three,
`prepare_input`, `prepare_output`) and torch's keyword arguments, layouts spelt `replicate`,
`shard(1)` or null:

    styles:
      self_attn: {style: prepare_input, input_layouts: [shard(1), null, null],
                  desired_input_layouts: [replicate, null, null]}
      "self_attn.{q_proj,k_proj,v_proj}": colwise
      self_attn.o_proj: {style: rowwise, output_layouts: shard(1)}

A rule with no style map (or an empty one) takes the module's own, `module.tp_plan(loss_parallel)` (composerun's
Llama and transformer have one), or for a transformers model (`+model=hf`) the plan transformers
gives it, its `base_model_tp_plan`, mapped onto these styles by models/hf_tp.py.  With
`loss_parallel: true` the module's output is the logits sharded over the vocabulary, and the
training loop computes the loss under torch's `loss_parallel()` (no gather of the logits).
"""

from __future__ import annotations

import re
from typing import Any

import torch.nn as nn

from composerun.config.schema import RuleConfig
from composerun.errors import ConfigError
from composerun.models.hf_tp import hf_styles, is_transformers, shared_parameters
from composerun.models.lora import adapters_set_aside, parallelize_adapter
from composerun.parallel.globs import ROOT, glob_to_regex

SPLITS_WEIGHT = ("colwise", "rowwise")
STYLE_KEYS = {
    "colwise": ("input_layouts", "output_layouts", "use_local_output"),
    "rowwise": ("input_layouts", "output_layouts", "use_local_output"),
    "sequence": ("sequence_dim", "use_local_output"),
    "prepare_input": ("input_layouts", "desired_input_layouts", "use_local_output"),
    "prepare_output": ("output_layouts", "desired_output_layouts", "use_local_output"),
}
_LAYOUT = re.compile(r"^(replicate|shard\((-?\d+)\))$")
_LAYOUT_KEYS = ("input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts")


def _layout(value: Any, where: str) -> None:
    """A layout (or a tuple of them, one per input) is spelt replicate, shard(N) or null."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if v is not None and not (isinstance(v, str) and _LAYOUT.match(v.strip().lower())):
            raise ConfigError(f"{where}={v!r}: a layout is replicate, shard(N) (N a tensor dim) or null")


def normalize(value: Any, where: str) -> dict[str, Any]:
    """A style as the dict {style: NAME, ...torch's keyword arguments}, checked."""
    spec = {"style": value} if isinstance(value, str) else dict(value) if isinstance(value, dict) else None
    if spec is None or not isinstance(spec.get("style"), str):
        raise ConfigError(f"{where}: a style is one of {', '.join(STYLE_KEYS)}, or a dict with `style` and its options")
    name = spec["style"]
    if name not in STYLE_KEYS:
        raise ConfigError(f"{where}: unknown style {name!r}; the styles are {', '.join(STYLE_KEYS)}")
    for key, v in spec.items():
        if key == "style":
            continue
        if key not in STYLE_KEYS[name]:
            raise ConfigError(f"{where}.{key}: style {name} takes {', '.join(STYLE_KEYS[name])}")
        if key in _LAYOUT_KEYS:
            _layout(v, f"{where}.{key}")
        elif key == "use_local_output" and not isinstance(v, bool):
            raise ConfigError(f"{where}.use_local_output={v!r}: true or false")
        elif key == "sequence_dim" and not isinstance(v, int):
            raise ConfigError(f"{where}.sequence_dim={v!r}: a tensor dim (an integer)")
    return spec


def _placement(text: str | None) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if text is None:
        return None
    m = _LAYOUT.match(text.strip().lower())
    assert m is not None, text
    return Replicate() if m.group(1) == "replicate" else Shard(int(m.group(2)))


def to_style(spec: dict[str, Any]) -> Any:
    """torch's ParallelStyle for a normalized style."""
    from torch.distributed.tensor import parallel as tp

    kinds = {
        "colwise": tp.ColwiseParallel,
        "rowwise": tp.RowwiseParallel,
        "sequence": tp.SequenceParallel,
        "prepare_input": tp.PrepareModuleInput,
        "prepare_output": tp.PrepareModuleOutput,
    }
    kwargs = {}
    for key, v in spec.items():
        if key == "style":
            continue
        if key in _LAYOUT_KEYS:
            v = tuple(_placement(x) for x in v) if isinstance(v, (list, tuple)) else _placement(v)
        kwargs[key] = v
    return kinds[spec["style"]](**kwargs)


def describe(spec: dict[str, Any]) -> str:
    """A style in a few characters, for the plan table: rowwise(out=shard(1))."""
    short = {
        "input_layouts": "in",
        "output_layouts": "out",
        "desired_input_layouts": "to",
        "desired_output_layouts": "to",
    }
    extra = [
        f"{short.get(k, k)}={'/'.join(str(x) for x in v) if isinstance(v, (list, tuple)) else v}"
        for k, v in spec.items()
        if k != "style"
    ]
    return spec["style"] + (f"({','.join(extra)})" if extra else "")


def resolve_styles(root: nn.Module, fqn: str, rule: RuleConfig, where: str, tp: int | None) -> dict[str, Any]:
    """What a `parallelize` rule on module `fqn` of `root` applies (plan.json's api_options):
    {"styles": {relative FQN: style dict}, in the module's order, "loss_parallel": ...}.  The
    rule's style map, or the module's own `tp_plan()`, or for one of transformers' models the
    plan transformers gives it (models/hf_tp.py, which may leave parts whole: "unsplit").  Every
    glob is expanded to the submodules it names, each checked: it exists, colwise/rowwise name a
    Linear or an Embedding that no other module shares, no submodule gets two styles, and the
    heads divide over `tp` ranks."""
    module = root.get_submodule(fqn)
    name = fqn or ROOT
    styles = rule.styles
    options: dict[str, Any] = {"loss_parallel": rule.loss_parallel}
    if not styles and not callable(getattr(module, "tp_plan", None)) and is_transformers(root):
        options = hf_styles(root, fqn, rule.loss_parallel, tp, where)
        styles = options["styles"]
        if not styles:  # (tied embeddings: the root's plan leaves both whole)
            return options
    elif not styles:
        own = getattr(module, "tp_plan", None)
        if not callable(own):
            raise ConfigError(
                f"{where}: module {name!r} ({type(module).__name__}) has no tp_plan() of its own; "
                f"give the rule a style map (styles: {{submodule: colwise, ...}})"
            )
        try:
            styles = own(loss_parallel=rule.loss_parallel)
        except ValueError as e:
            raise ConfigError(f"{where}: {type(module).__name__}.tp_plan(): {e}") from None
    if not isinstance(styles, dict) or not styles:
        raise ConfigError(f"{where}.styles: a map of {{submodule: style}}, e.g. {{q_proj: colwise}}")
    subs = dict(module.named_modules())
    out: dict[str, dict[str, Any]] = {}
    for key, value in styles.items():
        spec = normalize(value, f"{where}.styles.{key}")
        rx = glob_to_regex(str(key))
        hits = [n for n in subs if n and rx.match(n)]
        if not hits:
            raise ConfigError(
                f"{where}.styles: {key!r} names no submodule of {name!r} ({type(module).__name__}); "
                f"its children are {[n for n, _ in module.named_children()]}"
            )
        for sub in hits:
            target = subs[sub]
            if spec["style"] in SPLITS_WEIGHT and not isinstance(target, (nn.Linear, nn.Embedding)):
                raise ConfigError(
                    f"{where}.styles.{key}: {spec['style']} splits a Linear's or an Embedding's weight, and "
                    f"{_join(fqn, sub)!r} is a {type(target).__name__}"
                )
            if sub in out:
                raise ConfigError(f"{where}.styles: {_join(fqn, sub)!r} is given two styles; give it one")
            out[sub] = spec
    shared = shared_parameters(root)
    if any(id(p) in shared for sub in out for p in subs[sub].parameters()):
        raise ConfigError(
            f"{where}: module {name!r} has tied weights (one parameter in two modules), which "
            "tensor parallelism cannot split: untie them (model.kwargs.tie_embeddings=false)"
        )
    if tp:
        check_heads(module, fqn, tp, where)
    resolved = {sub: out[sub] for sub in subs if sub in out}
    return {"styles": resolved, **{k: v for k, v in options.items() if k != "styles"}}


def _join(fqn: str, sub: str) -> str:
    return f"{fqn}.{sub}" if fqn else sub


def check_heads(module: nn.Module, fqn: str, tp: int, where: str) -> None:
    """Attention heads (a module's `n_heads` / `n_kv_heads`) split evenly over the tp ranks."""
    for sub, m in module.named_modules():
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(m, attr, None)
            if isinstance(heads, int) and heads % tp:
                raise ConfigError(
                    f"{where}: {_join(fqn, sub) or 'the model'} has {attr}={heads}, which {tp} tensor-parallel "
                    f"ranks cannot split evenly: use a tp dim that divides {heads} (mesh), or another model.{attr}"
                )


def parallelize(module: nn.Module, styles: dict[str, dict[str, Any]], tp_mesh: Any) -> None:
    """Apply a resolved style map with torch's parallelize_module.  Each rank cuts its own
    part of its own weights (src_data_rank=None: no broadcast; on the meta device there are
    no values yet, and models/init.py fills each rank's part from the seed)."""
    from torch.distributed.tensor.parallel import parallelize_module

    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    with adapters_set_aside(module):
        parallelize_module(module, tp_mesh, {sub: to_style(spec) for sub, spec in styles.items()}, src_data_rank=None)
    for name, p in module.named_parameters():  # (the styles make new Parameters, which train unless told otherwise)
        if name in frozen:
            p.requires_grad_(False)
    for sub, spec in styles.items():  # adapter=lora: each adapter split as its linear is (models/lora.py)
        if spec["style"] in SPLITS_WEIGHT:
            parallelize_adapter(module.get_submodule(sub), spec["style"], tp_mesh)
