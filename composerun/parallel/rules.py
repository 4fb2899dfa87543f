"""Sharding policies: an ordered list of rules becomes a plan (FQN -> APIs + options),
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

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from composerun.config.schema import NON_DATA_PARALLEL_DIMS, RuleConfig, ShardingConfig
from composerun.errors import ConfigError

ROOT = "<root>"
TP_DIM = "tp"  # the mesh dim tensor parallelism runs over

DP_APIS = ("fully_shard", "replicate")  # the APIs that own parameters and sync gradients

# The phases of the module docstring: every module's APIs of one phase before the next phase.
APPLY_ORDER = {"float8": 0, "parallelize": 1, "checkpoint": 2, "compile": 3, "replicate": 4, "fully_shard": 4}

AC_MODES = ("full", "selective", "budget")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Which rule options belong to which API (any other API given one is a mistake to point out).
API_OF_OPTION = {
    "save_ops": ("checkpoint",),
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


def _glob_to_regex(glob: str) -> re.Pattern:
    if glob == ROOT:
        return re.compile(r"^$")
    out = ""
    for tok in re.split(r"(\*\*|\*|\{[^{}]*\})", glob):
        if tok.startswith("{") and tok.endswith("}"):  # {blocks,layers}: either name
            out += "(?:" + "|".join(re.escape(alt) for alt in tok[1:-1].split(",")) + ")"
        else:
            out += {"**": r".*", "*": r"[^.]+"}.get(tok, re.escape(tok))
    return re.compile(f"^{out}$")


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
    """The policy's rules with its defaults (mixed precision) filled in where a rule is silent."""
    out = []
    for rule in sharding.rules:
        if _api(rule) in DP_APIS:
            rule = replace(
                rule,
                param_dtype=rule.param_dtype if rule.param_dtype is not None else sharding.param_dtype,
                reduce_dtype=rule.reduce_dtype if rule.reduce_dtype is not None else sharding.reduce_dtype,
            )
        out.append(rule)
    return out


def data_parallel_dims(dim_names: list[str]) -> list[str]:
    """The mesh dims over which ranks hold different samples (every dim but `tp`)."""
    return [d for d in dim_names if d not in NON_DATA_PARALLEL_DIMS]


def check_policy(sharding: ShardingConfig, dim_names: list[str], shape: list[int]) -> None:
    """Policy checks that need no model: run before any rank starts."""
    rules = effective_rules(sharding)
    name = sharding.name or "this policy"
    sizes = dict(zip(dim_names, shape, strict=True))
    replicas = 1
    for d in data_parallel_dims(dim_names):
        replicas *= sizes[d]
    if replicas > 1 and not any(_api(r) in DP_APIS for r in rules):
        raise ConfigError(
            f"sharding={name} has no fully_shard/replicate rule, so {replicas} data-parallel replicas would train "
            f"{replicas} unsynchronised copies: use mesh=1, or a policy such as sharding=fsdp"
        )
    for key in ("prefetch_forward", "prefetch_backward"):
        if getattr(sharding, key) < 0:
            raise ConfigError(f"sharding.{key}={getattr(sharding, key)}: must be 0 or more")
    wanted = sharding.mesh_dim_names
    if wanted and list(dim_names) != list(wanted) and TP_DIM in wanted and TP_DIM not in dim_names:
        raise ConfigError(
            f"sharding={name} names the dims of a {len(wanted)}-D mesh {list(wanted)}, but the mesh "
            f"{'x'.join(map(str, shape))} has dims {list(dim_names)}: use a {len(wanted)}-D mesh such as "
            f"mesh={'x'.join(['2'] * len(wanted))}, or name a `tp` dim yourself (mesh.dim_names)"
        )
    check_rules_against_mesh(rules, dim_names)


def check_rules_against_mesh(rules: list[RuleConfig], dim_names: list[str]) -> None:
    """Mesh checks that need no model: run before any rank starts."""
    budgets = set()
    for i, rule in enumerate(rules):
        api = _api(rule)
        if rule.match is None and not rule.class_name:
            raise ConfigError(f"{rule_label(i, rule)}: give `match` (an FQN glob) and/or `class_name`")
        if rule.every < 1:
            raise ConfigError(f"{rule_label(i, rule)}.every={rule.every}: must be 1 (every match) or more")
        _check_options_belong(i, rule)
        if api == "checkpoint":
            _check_checkpoint(i, rule)
            if rule.mode == "budget":
                budgets.add(rule.memory_budget)
        elif api == "compile":
            from composerun.parallel.compile import check_compile_options

            check_compile_options(rule_label(i, rule), rule)
        dims = rule.mesh_dims
        if api == "parallelize":
            if TP_DIM not in dim_names:
                raise ConfigError(
                    f"{rule_label(i, rule)}: parallelize runs over the mesh dim `tp`, and the mesh's dims are "
                    f"{dim_names}: name one `tp` (mesh.dim_names, e.g. [shard, tp] on mesh=2x2), or use a policy "
                    "that does (sharding=tp, fsdp_tp, hsdp_tp)"
                )
            if dims is not None and list(dims) != [TP_DIM]:
                raise ConfigError(
                    f"{rule_label(i, rule)}.mesh_dims={list(dims)}: parallelize runs over [tp]; omit mesh_dims"
                )
            continue
        if api not in DP_APIS:
            if dims:
                raise ConfigError(f"{rule_label(i, rule)}.mesh_dims: {api} runs on no mesh; remove mesh_dims")
            continue
        if not data_parallel_dims(dim_names):
            raise ConfigError(
                f"{rule_label(i, rule)}: {api} runs over data-parallel mesh dims, and the mesh's only dims are "
                f"{dim_names} (tensor parallelism's): use sharding=tp, or a mesh with a data-parallel dim "
                "(sharding=fsdp_tp on mesh=2x2)"
            )
        if dims is None:
            continue
        _check_dp_dims(i, rule, api, list(dims), dim_names)
    if len(budgets) > 1:
        raise ConfigError(
            f"checkpoint rules of mode budget give memory_budget {sorted(budgets)}: the compiler takes one budget "
            "for the whole run; give every rule the same"
        )


def _check_options_belong(i: int, rule: RuleConfig) -> None:
    """An option set on a rule of an API that has no use for it (it would silently do nothing)."""
    api = _api(rule)
    for option, apis in API_OF_OPTION.items():
        value = getattr(rule, option)
        if api not in apis and value != _OPTION_DEFAULTS[option]:
            raise ConfigError(
                f"{rule_label(i, rule)}.{option}: an option of api {' or '.join(apis)}, not of {api}; remove it"
            )


def _check_checkpoint(i: int, rule: RuleConfig) -> None:
    where = rule_label(i, rule)
    mode = rule.mode or "full"
    if mode not in AC_MODES:
        raise ConfigError(f"{where}.mode={rule.mode}: checkpoint's modes are {', '.join(AC_MODES)}")
    if rule.save_ops is not None and mode != "selective":
        raise ConfigError(f"{where}.save_ops: the ops selective checkpointing saves; set mode: selective, or remove it")
    if mode == "selective":
        from composerun.parallel.compile import resolve_ops

        resolve_ops(f"{where}.save_ops", rule.save_ops)
    if mode == "budget":
        b = rule.memory_budget
        if b is None or not 0 <= b <= 1:
            raise ConfigError(
                f"{where}.memory_budget={b}: mode budget needs a fraction of activation memory between 0 "
                "(recompute everything) and 1 (save everything)"
            )
    elif rule.memory_budget is not None:
        raise ConfigError(f"{where}.memory_budget: the budget of mode budget; set mode: budget, or remove it")


def _check_dp_dims(i: int, rule: RuleConfig, api: str, dims: list[str], dim_names: list[str]) -> None:
    dp_names = data_parallel_dims(dim_names)
    if api == "fully_shard" and len(dims) == 2 and len(dim_names) == 1:
        raise ConfigError(
            f"{rule_label(i, rule)}.mesh_dims={dims}: HSDP needs a 2-D mesh such as mesh=2x2, "
            f"but the mesh is 1-D; use sharding=fsdp for a 1-D mesh"
        )
    unknown = [d for d in dims if d not in dim_names]
    if unknown:
        raise ConfigError(
            f"{rule_label(i, rule)}.mesh_dims={dims}: the mesh has no dim {unknown[0]!r} (its dims are {dim_names})"
        )
    if TP_DIM in dims:
        raise ConfigError(
            f"{rule_label(i, rule)}.mesh_dims={dims}: `tp` is tensor parallelism's dim (api: parallelize); "
            f"{api} runs over the data-parallel dims {dp_names}"
        )
    twice = next((d for d in dims if dims.count(d) > 1), None)
    if twice is not None:
        raise ConfigError(f"{rule_label(i, rule)}.mesh_dims={dims} names dim {twice!r} twice; name it once")
    in_order = [d for d in dim_names if d in dims]
    if dims != in_order:
        # torch's DeviceMesh takes sub-meshes in its own dim order only, and a whole 2-D mesh
        # would silently replicate over its first dim and shard over its second
        raise ConfigError(
            f"{rule_label(i, rule)}.mesh_dims={dims}: list the dims in the mesh's order, {in_order} "
            f"(HSDP replicates over the first and shards over the second); to swap their roles, "
            f"swap the mesh's dims (mesh.shape, mesh.dim_names)"
        )
    if sorted(dims) != sorted(dp_names):
        raise ConfigError(
            f"{rule_label(i, rule)}.mesh_dims={dims} leaves mesh dims "
            f"{[d for d in dp_names if d not in dims]} unsynchronised; name them all, or omit mesh_dims"
        )
    if api == "replicate" and len(dims) != 1:
        raise ConfigError(f"{rule_label(i, rule)}: replicate runs on one mesh dim; omit mesh_dims")
    if api == "fully_shard" and len(dims) > 2:
        raise ConfigError(f"{rule_label(i, rule)}: fully_shard runs on 1 or 2 mesh dims, not {len(dims)}")


def make_plan(model: nn.Module, rules: list[RuleConfig], mesh_sizes: dict[str, int] | None = None) -> dict[str, Unit]:
    """Match every rule against the model; the plan lists modules in apply order (children
    before parents, the root last).  `mesh_sizes` ({dim: ranks}): checks that need the mesh
    (a tensor-parallel degree that divides the heads)."""
    modules = dict(model.named_modules())
    units: dict[str, Unit] = {}
    for i, rule in enumerate(rules):
        api = _api(rule)
        glob = rule.match
        rx = _glob_to_regex(glob) if glob is not None else None
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
        for fqn in hits:
            u = units.setdefault(fqn, Unit(fqn=fqn, cls=type(modules[fqn]).__name__))
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
                u.api_options[api] = api_options(rule, modules[fqn], fqn, rule_label(i, rule), mesh_sizes)
    # Children before parents (deepest first), the root last; within a module, the phases' order.
    order = sorted(units.values(), key=lambda u: -(u.fqn.count(".") + 1 if u.fqn else 0))
    for u in order:
        pairs = sorted(zip(u.apis, u.rules, strict=True), key=lambda ar: APPLY_ORDER[ar[0]])
        u.apis, u.rules = [a for a, _ in pairs], [r for _, r in pairs]
    plan = {u.fqn: u for u in order}
    _across_modules(plan, rules)
    return plan


def api_options(
    rule: RuleConfig, module: nn.Module, fqn: str, where: str, mesh_sizes: dict[str, int] | None
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
        styles = resolve_styles(module, fqn, rule, where, tp)
        return {"styles": styles, "loss_parallel": rule.loss_parallel}
    if api == "float8":
        from composerun.parallel.float8 import float8_targets

        return float8_targets(module, rule.float8_all_gather)
    raise AssertionError(api)


def _across_modules(plan: dict[str, Unit], rules: list[RuleConfig]) -> None:
    """What one module's rules cannot tell: a compiler's memory budget needs the module (or
    one holding it) compiled; float8's linears may not also be split by tensor parallelism,
    and all-gather in float8 (unless told not to) where fully_shard holds them."""

    def compiled_at_or_above(fqn: str) -> bool:
        return any("compile" in u.apis and (f == fqn or f == "" or fqn.startswith(f + ".")) for f, u in plan.items())

    for fqn, u in plan.items():
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
                f8["all_gather"] = any("fully_shard" in v.apis and _nested(f, fqn) for f, v in plan.items())
            tp = next((f for f, v in plan.items() if "parallelize" in v.apis and _nested(f, fqn)), None)
            if tp is not None:
                i = u.rules[u.apis.index("float8")]
                raise ConfigError(
                    f"{rule_label(i, rules[i])}: float8 with tensor parallelism on the same linears "
                    f"(module {tp or ROOT!r} is parallelized) is not supported by composerun yet; "
                    "use float8 with fully_shard (sharding=fsdp_blocks_float8)"
                )


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


def unit_params(model: nn.Module, plan: dict[str, Unit]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Each parameter, assigned to its innermost data-parallel unit; one that no data-parallel
    unit holds, to its innermost parallelized module (a tensor-parallel-only policy); '' holds
    the rest."""

    def innermost(pred: Any) -> list[str]:
        return sorted((f for f, u in plan.items() if pred(u)), key=len, reverse=True)

    owners = innermost(lambda u: any(a in DP_APIS for a in u.apis))
    tp_owners = innermost(lambda u: "parallelize" in u.apis)
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        owner = next((o for o in owners if o == "" or name.startswith(o + ".")), None)
        if owner is None:
            owner = next((o for o in tp_owners if o == "" or name.startswith(o + ".")), "")
        out.setdefault(owner, []).append((name, p))
    return out
