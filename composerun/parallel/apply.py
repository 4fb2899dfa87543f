"""Applying a plan: each planned module gets its composable APIs (children before parents,
the root last; activation checkpointing before sharding on one module), on the sub-mesh its
rule names; then torch's per-module registry is read back to check that what was planned is
what torch holds, and FSDP's runtime switches (prefetching) are set."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from composerun import _torch_compat as compat
from composerun.config.schema import RuleConfig, ShardingConfig
from composerun.errors import ConfigError
from composerun.parallel.rules import DP_APIS, ROOT, Unit, effective_rules, make_plan, rule_label


class MeshPicker:
    """The sub-mesh each rule runs on: the whole mesh for HSDP or a 1-D mesh, and one
    flattened 1-D mesh over every rank when a rule names no dims on a 2-D mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._flat: DeviceMesh | None = None

    def __call__(self, dims: list[str] | None) -> DeviceMesh:
        if dims is not None or self.mesh.ndim == 1:
            return self.mesh if dims is None or len(dims) == self.mesh.ndim else self.mesh[tuple(dims)]
        if self._flat is None:
            # a 1-D mesh over every rank (new process groups; every rank builds it, same plan)
            self._flat = init_device_mesh(self.mesh.device_type, (self.mesh.size(),), mesh_dim_names=("dp",))
        return self._flat


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def apply_plan(model: nn.Module, plan: dict[str, Unit], mesh: DeviceMesh) -> None:
    pick = MeshPicker(mesh)
    modules = dict(model.named_modules())
    for u in plan.values():
        module = modules[u.fqn]
        for api in u.apis:
            if api == "checkpoint":
                compat.checkpoint(module)
                continue
            o = u.options
            mp = MixedPrecisionPolicy(
                param_dtype=_dtype(o.get("param_dtype")), reduce_dtype=_dtype(o.get("reduce_dtype"))
            )
            kwargs: dict[str, Any] = {"mesh": pick(u.mesh_dims), "mp_policy": mp}
            if api == "fully_shard":
                if o.get("reshard_after_forward") is not None:
                    kwargs["reshard_after_forward"] = o["reshard_after_forward"]
                if o.get("offload"):
                    # pin_memory needs an accelerator (PITFALLS §4.2)
                    kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                fully_shard(module, **kwargs)
            else:
                compat.replicate(module, **kwargs)


def verify_plan(model: nn.Module, plan: dict[str, Unit], rules: list[RuleConfig], require_coverage: bool) -> None:
    """Read torch's registry back: every planned API registered, nothing unplanned, and
    (when required) every parameter inside some data-parallel unit."""
    for fqn, module in model.named_modules():
        got = compat.registered_apis(module)
        want = plan[fqn].apis if fqn in plan else []
        if sorted(got) != sorted(want):
            where = rule_label(plan[fqn].rules[0], rules[plan[fqn].rules[0]]) if fqn in plan else "no rule"
            raise ConfigError(
                f"module {fqn or ROOT!r}: torch's registry shows {got or 'no API'} but {where} planned {want or 'none'}"
            )
    if not require_coverage:
        return
    owned = [fqn for fqn, u in plan.items() if any(a in DP_APIS for a in u.apis)]
    for name, _ in model.named_parameters():
        if not any(o == "" or name.startswith(o + ".") for o in owned):
            raise ConfigError(
                f"parameter {name!r} is in no fully_shard/replicate unit: add a rule for it or for {ROOT}, "
                f"or set sharding.require_coverage=false"
            )


def set_runtime_switches(model: nn.Module, sharding: ShardingConfig) -> None:
    """FSDP's explicit prefetching.  (reshard_after_backward is switched per micro-batch
    by the training loop: parameters must be resharded before the optimizer steps.)"""
    # fully_shard units other than the root, in forward (registration) order
    units = [m for fqn, m in model.named_modules() if fqn and "fully_shard" in compat.registered_apis(m)]
    fwd, bwd = sharding.prefetch_forward, sharding.prefetch_backward
    for i, unit in enumerate(units):
        if fwd and units[i + 1 : i + 1 + fwd]:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + fwd])
        if bwd and units[max(0, i - bwd) : i]:
            unit.set_modules_to_backward_prefetch(units[max(0, i - bwd) : i][::-1])


def apply_policy(model: nn.Module, sharding: ShardingConfig, mesh: DeviceMesh) -> dict[str, Unit]:
    rules = effective_rules(sharding)
    plan = make_plan(model, rules)
    apply_plan(model, plan, mesh)
    verify_plan(model, plan, rules, sharding.require_coverage)
    set_runtime_switches(model, sharding)
    return plan
