"""Sharding policies: an ordered list of rules becomes a plan (FQN -> APIs + options),
applied bottom-up through torch's composable APIs (apply.py) and then checked against
torch's own per-module state registry.

A rule selects modules by FQN glob (`*` one name, `**` any depth, `{a,b}` either name,
`<root>` the model)
and/or class name, and names an API: `fully_shard` (FSDP2; HSDP when it runs over two
mesh dims), `replicate` (DDP-style, FSDP2 family) or `checkpoint` (activation
checkpointing).  Applying an API never renames a parameter, so the state-dict keys are
the same under every policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from composerun.config.schema import RuleConfig, ShardingConfig
from composerun.errors import ConfigError

ROOT = "<root>"

DP_APIS = ("fully_shard", "replicate")  # the APIs that own parameters and sync gradients

APPLY_ORDER = {"checkpoint": 0, "replicate": 1, "fully_shard": 1}  # AC before sharding, same module


@dataclass
class Unit:
    fqn: str
    cls: str
    apis: list[str] = field(default_factory=list)
    rules: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    mesh_dims: list[str] | None = None


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


def check_policy(sharding: ShardingConfig, dim_names: list[str], world: int) -> None:
    """Policy checks that need no model: run before any rank starts."""
    rules = effective_rules(sharding)
    name = sharding.name or "this policy"
    if world > 1 and not any(_api(r) in DP_APIS for r in rules):
        raise ConfigError(
            f"sharding={name} has no fully_shard/replicate rule, so {world} ranks would train "
            f"{world} unsynchronised copies: use mesh=1, or a policy such as sharding=fsdp"
        )
    for key in ("prefetch_forward", "prefetch_backward"):
        if getattr(sharding, key) < 0:
            raise ConfigError(f"sharding.{key}={getattr(sharding, key)}: must be 0 or more")
    check_rules_against_mesh(rules, dim_names)


def check_rules_against_mesh(rules: list[RuleConfig], dim_names: list[str]) -> None:
    """Mesh checks that need no model: run before any rank starts."""
    for i, rule in enumerate(rules):
        api = _api(rule)
        if rule.match is None and not rule.class_name:
            raise ConfigError(f"{rule_label(i, rule)}: give `match` (an FQN glob) and/or `class_name`")
        if rule.every < 1:
            raise ConfigError(f"{rule_label(i, rule)}.every={rule.every}: must be 1 (every match) or more")
        dims = rule.mesh_dims
        if api not in DP_APIS:
            if dims:
                raise ConfigError(f"{rule_label(i, rule)}.mesh_dims: {api} runs on no mesh; remove mesh_dims")
            continue
        if dims is None:
            continue
        if api == "fully_shard" and len(dims) == 2 and len(dim_names) == 1:
            raise ConfigError(
                f"{rule_label(i, rule)}.mesh_dims={list(dims)}: HSDP needs a 2-D mesh such as mesh=2x2, "
                f"but the mesh is 1-D; use sharding=fsdp for a 1-D mesh"
            )
        unknown = [d for d in dims if d not in dim_names]
        if unknown:
            raise ConfigError(
                f"{rule_label(i, rule)}.mesh_dims={list(dims)}: the mesh has no dim {unknown[0]!r} "
                f"(its dims are {dim_names})"
            )
        twice = next((d for d in dims if list(dims).count(d) > 1), None)
        if twice is not None:
            raise ConfigError(f"{rule_label(i, rule)}.mesh_dims={list(dims)} names dim {twice!r} twice; name it once")
        in_order = [d for d in dim_names if d in dims]
        if list(dims) != in_order:
            # torch's DeviceMesh takes sub-meshes in its own dim order only, and a whole 2-D mesh
            # would silently replicate over its first dim and shard over its second
            raise ConfigError(
                f"{rule_label(i, rule)}.mesh_dims={list(dims)}: list the dims in the mesh's order, {in_order} "
                f"(HSDP replicates over the first and shards over the second); to swap their roles, "
                f"swap the mesh's dims (mesh.shape, mesh.dim_names)"
            )
        if sorted(dims) != sorted(dim_names):
            raise ConfigError(
                f"{rule_label(i, rule)}.mesh_dims={list(dims)} leaves mesh dims "
                f"{[d for d in dim_names if d not in dims]} unsynchronised; name them all, or omit mesh_dims"
            )
        if api == "replicate" and len(dims) != 1:
            raise ConfigError(f"{rule_label(i, rule)}: replicate runs on one mesh dim; omit mesh_dims")
        if api == "fully_shard" and len(dims) > 2:
            raise ConfigError(f"{rule_label(i, rule)}: fully_shard runs on 1 or 2 mesh dims, not {len(dims)}")


def make_plan(model: nn.Module, rules: list[RuleConfig]) -> dict[str, Unit]:
    """Match every rule against the model; the plan lists modules in apply order."""
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
    # Children before parents (deepest first), the root last; AC before sharding on one module.
    order = sorted(units.values(), key=lambda u: -(u.fqn.count(".") + 1 if u.fqn else 0))
    for u in order:
        u.apis.sort(key=APPLY_ORDER.__getitem__)
    return {u.fqn: u for u in order}


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
    """Each parameter, assigned to its innermost data-parallel unit ('' holds the rest)."""
    owners = sorted((f for f, u in plan.items() if any(a in DP_APIS for a in u.apis)), key=len, reverse=True)
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        owner = next((o for o in owners if o == "" or name.startswith(o + ".")), "")
        out.setdefault(owner, []).append((name, p))
    return out
