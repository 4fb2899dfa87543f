"""Sharding policies: an ordered list of rules assigns units (FQN -> APIs + options),
applied through torch's composable APIs (apply.py) and then checked against torch's own
per-module state registry.

A rule selects modules by FQN glob (`*` one name, `**` any depth, `{a,b}` either name,
`<root>` the model)
and/or class name, and names an API: `fully_shard` (FSDP2; HSDP when it runs over two
mesh dims), `replicate` (DDP-style, FSDP2 family), `checkpoint` (activation checkpointing:
full, selective or a compiler's memory budget), `compile` (torch.compile of the module's
forward), `float8` (torchao's float8 training of its linears) or `parallelize` (tensor and
sequence parallelism over the mesh dim `tp`).  Applying an API never renames a parameter,
so the state-dict keys are the same under every policy.

The APIs are applied in one fixed order, each over every module that has it before the
next begins (torchtitan's order; `APPLY_ORDER`):

1. float8 swaps a module's linears for torchao's Float8Linear: the swap must come before
   anything that holds the linear (tensor parallelism's sharded weights, FSDP's units);
2. parallelize turns the weights into tensor-parallel DTensors over `tp`: FSDP then shards
   what TP already split (2-D parameters), never the other way round;
3. checkpoint: AC wraps the module's forward as it is, tensor-parallel collectives included
   (they are recomputed with it);
4. compile: the compiled forward then holds the AC region (torch.compile traces
   torch.utils.checkpoint and its selective policy) and the TP collectives;
5. fully_shard / replicate last: their hooks (all-gather before forward, reduce-scatter
   after backward) run outside the compiled region, around it, children before parents
   and the root last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from composerun.config.schema import NON_DATA_PARALLEL_DIMS, DType, RuleConfig, ShardingConfig
from composerun.errors import ConfigError
from composerun.parallel.globs import ROOT, glob_to_regex

TP_DIM = "tp"  # the mesh dim tensor parallelism runs over

DP_APIS = ("fully_shard", "replicate")  # the APIs that own parameters and sync gradients
LOW_PRECISION = (DType.bfloat16, DType.float16)  # parameter dtypes whose gradients reduce in float32

# The phases of the module docstring: every module's APIs of one phase before the next phase.
APPLY_ORDER = {"float8": 0, "parallelize": 1, "checkpoint": 2, "compile": 3, "replicate": 4, "fully_shard": 4}

AC_MODES = ("full", "selective", "budget")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Which rule options belong to which API (any other API given one is a mistake to point out).
API_OF_OPTION = {
    "save_ops": ("checkpoint",),
    "save_mm_every": ("checkpoint",),
    "memory_budget": ("checkpoint",),
    "fullgraph": ("compile",),
    "dynamic": ("compile",),
    "backend": ("compile",),
    "compile_options": ("compile",),
    "styles": ("parallelize",),
    "loss_parallel": ("parallelize",),
    "float8_all_gather": ("float8",),
    "mode": ("checkpoint", "compile"),
    "reshard_after_forward": DP_APIS,
    "param_dtype": DP_APIS,
    "reduce_dtype": DP_APIS,
    "offload": DP_APIS,
}
_OPTION_DEFAULTS = {f: getattr(RuleConfig(api=None), f) for f in API_OF_OPTION}  # type: ignore[arg-type]


@dataclass
class Unit:
    fqn: str
    cls: str
    apis: list[str] = field(default_factory=list)
    rules: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # the data-parallel API's options
    mesh_dims: list[str] | None = None
    # every other API's options, resolved against the module (plan.json's `api_options`)
    api_options: dict[str, dict[str, Any]] = field(default_factory=dict)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_container(module: nn.Module) -> bool:
    # ModuleList/ModuleDict have no forward, so FSDP's hooks on them would never fire.
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def rule_label(i: int, rule: RuleConfig) -> str:
    sel = [f"match={rule.match!r}"] if rule.match is not None else []
    if rule.class_name:
        sel.append(f"class_name={rule.class_name!r}")
    return f"sharding.rules[{i}] ({', '.join(sel) or 'no selector'})"


def _api(rule: RuleConfig) -> str:
    return rule.api.value


def effective_rules(sharding: ShardingConfig) -> list[RuleConfig]:
    """The policy's rules with its defaults (mixed precision) filled in where a rule is silent.
    Parameters in bf16 or fp16 with no reduce_dtype (on the rule or the policy) reduce their
    gradients in float32: FSDP would otherwise sum the ranks' gradients in the parameters'
    8-bit mantissa (torchtitan's default too).  An explicit reduce_dtype is kept."""
    out = []
    for rule in sharding.rules:
        if _api(rule) in DP_APIS:
            param = rule.param_dtype if rule.param_dtype is not None else sharding.param_dtype
            reduce = rule.reduce_dtype if rule.reduce_dtype is not None else sharding.reduce_dtype
            if reduce is None and param in LOW_PRECISION:
                reduce = DType.float32
            rule = replace(rule, param_dtype=param, reduce_dtype=reduce)
        out.append(rule)
    return out


def data_parallel_dims(dim_names: list[str]) -> list[str]:
    """The mesh dims over which ranks hold different samples (every dim but `tp`)."""
    return [d for d in dim_names if d not in NON_DATA_PARALLEL_DIMS]


def assign_units(model: nn.Module, rules: list[RuleConfig], mesh_sizes: dict[str, int] | None = None) -> dict[str, Unit]:
    """Match every rule against the model; the units are listed in apply order (children
    before parents, the root last).  `mesh_sizes` ({dim: ranks}): checks that need the mesh
    (a tensor-parallel degree that divides the heads)."""
    modules = dict(model.named_modules())
    found: dict[str, Unit] = {}
    for i, rule in enumerate(rules):
        api = _api(rule)
        glob = rule.match
        rx = glob_to_regex(glob) if glob is not None else None
        cls = rule.class_name
        if cls and not any(type(m).__name__ == cls for m in modules.values()):
            raise ConfigError(f"{rule_label(i, rule)}: {type(model).__name__} has no module of class {cls!r}")
        hits = [
            fqn
            for fqn, m in modules.items()
            if (rx is None or rx.match(fqn))
            and (not cls or type(m).__name__ == cls)
            and _has_params(m)
            and not _is_container(m)
        ]
        hits = hits[:: rule.every]
        if not hits:
            raise ConfigError(
                f"{rule_label(i, rule)} matches no module with parameters in {type(model).__name__}; "
                f"top-level modules are {[n for n, _ in model.named_children()]}"
            )
        if api in DP_APIS:
            _check_ties(model, hits, rule_label(i, rule))
        for fqn in hits:
            u = found.setdefault(fqn, Unit(fqn=fqn, cls=type(modules[fqn]).__name__))
            if api in u.apis:
                j = u.rules[u.apis.index(api)]
                raise ConfigError(
                    f"{rule_label(i, rule)}: module {fqn or ROOT!r} is already given {api} by {rule_label(j, rules[j])}"
                )
            held = [a for a in u.apis if a in DP_APIS]
            if api in DP_APIS and held:
                raise ConfigError(
                    f"{rule_label(i, rule)}: module {fqn or ROOT!r} already has {held[0]}; one data-parallel API per module"
                )
            u.apis.append(api)
            u.rules.append(i)
            if api in DP_APIS:
                u.mesh_dims = list(rule.mesh_dims) if rule.mesh_dims else None
                u.options = unit_options(rule)
            else:
                u.api_options[api] = api_options(rule, model, fqn, rule_label(i, rule), mesh_sizes)
    # Children before parents (deepest first), the root last; within a module, the phases' order.
    order = sorted(found.values(), key=lambda u: -(u.fqn.count(".") + 1 if u.fqn else 0))
    for u in order:
        pairs = sorted(zip(u.apis, u.rules, strict=True), key=lambda ar: APPLY_ORDER[ar[0]])
        u.apis, u.rules = [a for a, _ in pairs], [r for _, r in pairs]
    units = {u.fqn: u for u in order}
    _across_modules(units, rules)
    return units


def _check_ties(model: nn.Module, hits: list[str], where: str) -> None:
    """A tied parameter (one tensor under two names, a transformers model's lm_head.weight and
    model.embed_tokens.weight) belongs in one data-parallel unit that holds both of its users:
    a unit holding one of them alone would free it before the other runs."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for tied in (n for n in names.values() if len(n) > 1):
        for fqn in hits:
            inside = [n for n in tied if fqn == "" or n.startswith(fqn + ".")]
            if inside and len(inside) < len(tied):
                outside = next(n for n in tied if n not in inside)
                raise ConfigError(
                    f"{where}: module {fqn!r} holds {inside[0]}, which is {outside} too (tied embeddings): one "
                    "unit must hold both; shard the blocks alone and the rest with the root (sharding=fsdp_blocks)"
                )


def api_options(
    rule: RuleConfig, model: nn.Module, fqn: str, where: str, mesh_sizes: dict[str, int] | None
) -> dict[str, Any]:
    """What an API other than a data-parallel one is given (plan.json's `api_options`): the
    rule's options, resolved against the module (the submodules a style map names, the linears
    float8 converts and those it skips)."""
    api = _api(rule)
    if api == "checkpoint":
        mode = rule.mode or "full"
        out: dict[str, Any] = {"mode": mode}
        if mode == "selective":
            from composerun.parallel.compile import resolve_ops

            out["save_ops"] = sorted(resolve_ops(f"{where}.save_ops", rule.save_ops))
            if rule.save_mm_every != 1:
                out["save_mm_every"] = rule.save_mm_every
        if mode == "budget":
            out["memory_budget"] = rule.memory_budget
        return out
    if api == "compile":
        out = {"mode": rule.mode or "default", "fullgraph": rule.fullgraph, "dynamic": rule.dynamic}
        out["backend"] = rule.backend
        if rule.compile_options:
            out["compile_options"] = dict(rule.compile_options)
        return out
    if api == "parallelize":
        from composerun.parallel.styles import resolve_styles

        tp = (mesh_sizes or {}).get(TP_DIM)
        return resolve_styles(model, fqn, rule, where, tp)
    if api == "float8":
        from composerun.parallel.float8 import float8_targets

        return float8_targets(model.get_submodule(fqn), rule.float8_all_gather)
    raise AssertionError(api)


def _across_modules(units: dict[str, Unit], rules: list[RuleConfig]) -> None:
    """What one module's rules cannot tell: a compiler's memory budget needs the module (or
    one holding it) compiled; float8's linears may not also be split by tensor parallelism,
    and all-gather in float8 (unless told not to) where fully_shard holds them."""

    def compiled_at_or_above(fqn: str) -> bool:
        return any("compile" in u.apis and (f == fqn or f == "" or fqn.startswith(f + ".")) for f, u in units.items())

    for fqn, u in units.items():
        ac = u.api_options.get("checkpoint")
        if ac and ac["mode"] == "budget" and not compiled_at_or_above(fqn):
            i = u.rules[u.apis.index("checkpoint")]
            raise ConfigError(
                f"{rule_label(i, rules[i])}: mode budget is the compiler's activation-memory budget, and module "
                f"{fqn or ROOT!r} is not compiled: add an `api: compile` rule for it (or one that holds it), "
                "or use mode: full or selective"
            )
        if "float8" in u.apis:
            f8 = u.api_options["float8"]
            if f8["all_gather"] is None:
                f8["all_gather"] = any("fully_shard" in v.apis and _nested(f, fqn) for f, v in units.items())
            converted = {_join(fqn, sub) for sub in f8["converted"]}
            split = {
                _join(f, sub)
                for f, v in units.items()
                for sub, spec in v.api_options.get("parallelize", {}).get("styles", {}).items()
                if spec["style"] in ("colwise", "rowwise")
            }
            both = sorted(converted & split)
            if both:
                i = u.rules[u.apis.index("float8")]
                raise ConfigError(
                    f"{rule_label(i, rules[i])}: float8 with tensor parallelism on the same linears ({both[0]} "
                    "is split by a parallelize rule too) is not supported by composerun yet; use float8 with "
                    "fully_shard (sharding=fsdp_blocks_float8)"
                )


def _join(fqn: str, sub: str) -> str:
    return f"{fqn}.{sub}" if fqn and sub else fqn or sub


def _nested(a: str, b: str) -> bool:
    """Whether module `a` holds module `b`, or `b` holds `a` (FQNs; '' is the root)."""
    return a == b or a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + ".")


def unit_options(rule: RuleConfig) -> dict[str, Any]:
    """What a data-parallel unit's API is given beyond its mesh (plan.json's `options`): the
    options its rule sets, dtypes by name."""
    options: dict[str, Any] = {}
    if rule.reshard_after_forward is not None:
        options["reshard_after_forward"] = rule.reshard_after_forward
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(rule, key) is not None:
            options[key] = getattr(rule, key).value
    if rule.offload:
        options["offload"] = True
    return options


def unit_params(model: nn.Module, units: dict[str, Unit]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Each parameter, assigned to its innermost data-parallel unit; one that no data-parallel
    unit holds, to its innermost parallelized module (a tensor-parallel-only policy); '' holds
    the rest."""

    def innermost(pred: Any) -> list[str]:
        return sorted((f for f, u in units.items() if pred(u)), key=len, reverse=True)

    owners = innermost(lambda u: any(a in DP_APIS for a in u.apis))
    tp_owners = innermost(lambda u: "parallelize" in u.apis)
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        owner = next((o for o in owners if o == "" or name.startswith(o + ".")), None)
        if owner is None:
            owner = next((o for o in tp_owners if o == "" or name.startswith(o + ".")), "")
        out.setdefault(owner, []).append((name, p))
    return out
