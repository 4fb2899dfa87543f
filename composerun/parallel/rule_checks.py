"""The checks of a policy that need no model, run before any rank starts (launch/preflight.py,
and plan=true): each rule's selector, API and options against the API, and its mesh dims
against the mesh's; the policy's data-parallel rules against its data-parallel replicas."""

from __future__ import annotations

from composerun.config.schema import RuleConfig, ShardingConfig
from composerun.errors import ConfigError
from composerun.parallel.rules import (
    _OPTION_DEFAULTS,
    AC_MODES,
    API_OF_OPTION,
    DP_APIS,
    TP_DIM,
    _api,
    data_parallel_dims,
    effective_rules,
    rule_label,
)


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
    _check_mixed_precision_has_a_holder(sharding, rules, name)
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


def _check_mixed_precision_has_a_holder(sharding: ShardingConfig, rules: list[RuleConfig], name: str) -> None:
    """sharding.param_dtype/reduce_dtype are the MixedPrecisionPolicy of fully_shard and
    replicate; a policy with neither (tensor parallelism alone, none) would silently train and
    communicate in fp32.  Refused, not applied with autocast: torchtitan too keeps mixed precision
    with tensor parallelism to FSDP (it warns and trains in fp32 without it)."""
    if any(_api(r) in DP_APIS for r in rules):
        return
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(sharding, key)
        if value is not None:
            raise ConfigError(
                f"sharding.{key}={value}: mixed precision is fully_shard's and replicate's, and sharding={name} has "
                f"neither, so it would train in the model's dtype: use a policy with fully_shard (sharding=fsdp_tp "
                f"on mesh=2x2 for tensor parallelism), or remove sharding.{key}"
            )


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
    if rule.save_mm_every != 1 and (mode != "selective" or rule.save_mm_every < 1):
        raise ConfigError(
            f"{where}.save_mm_every={rule.save_mm_every}: keeps every k-th matmul output of selective "
            "checkpointing; a whole number >= 1 with mode: selective"
        )
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
