"""Applying the units (rules.py: FQN -> APIs): the APIs in rules.py's fixed order (float8, parallelize, checkpoint,
compile, then the data-parallel APIs children before parents, the root last), each on the
sub-mesh its rule names; then torch's per-module registry is read back to check that what
was planned is what torch holds, and FSDP's runtime switches (prefetching) are set."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from composerun import _torch_compat as compat
from composerun.config.schema import RuleConfig, ShardingConfig
from composerun.errors import ConfigError
from composerun.parallel import compile as compiling
from composerun.parallel.rules import (
    APPLY_ORDER,
    DP_APIS,
    ROOT,
    TP_DIM,
    Unit,
    assign_units,
    data_parallel_dims,
    effective_rules,
    rule_label,
)


class MeshPicker:
    """The sub-mesh each rule runs on.  A data-parallel rule: the dims it names, or, naming
    none, every data-parallel dim (every dim but `tp`) as one: the mesh itself when it is
    1-D, else one flattened 1-D mesh over them.  A parallelize rule: the `tp` dim."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.names = list(mesh.mesh_dim_names or ())
        self._flat: DeviceMesh | None = None

    def __call__(self, dims: list[str] | None) -> DeviceMesh:
        if dims is not None:
            return self.mesh if len(dims) == self.mesh.ndim else self.mesh[tuple(dims)]
        dp = data_parallel_dims(self.names) if self.names else []
        if self.mesh.ndim == 1 or len(dp) == 1:
            return self.mesh if self.mesh.ndim == 1 else self.mesh[dp[0]]
        if self._flat is None:
            if len(dp) == self.mesh.ndim:
                # a 1-D mesh over every rank (new process groups; every rank builds it, same plan)
                self._flat = init_device_mesh(self.mesh.device_type, (self.mesh.size(),), mesh_dim_names=("dp",))
            else:  # beside a tp dim: flattened from the mesh, so FSDP composes with the TP weights
                self._flat = compat.flatten_mesh(self.mesh[tuple(dp)], "composerun_dp")
        return self._flat

    def tp(self) -> DeviceMesh:
        return self.mesh if self.mesh.ndim == 1 else self.mesh[TP_DIM]


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def apply_units(
    model: nn.Module,
    units: dict[str, Unit],
    mesh: DeviceMesh,
    rules: list[RuleConfig] | None = None,
    compile_fallback: bool = False,
) -> None:
    pick = MeshPicker(mesh)
    modules = dict(model.named_modules())
    # the compiler's activation-memory budget is one setting of the process: this plan's (mode
    # budget), else torch's default, never one left by an earlier run of the same process
    budgets = [o["memory_budget"] for u in units.values() if (o := u.api_options.get("checkpoint", {})).get("mode") == "budget"]
    compiling.set_memory_budget(budgets[0] if budgets else None)
    phases = sorted(set(APPLY_ORDER.values()))
    for phase in phases:  # every module's APIs of a phase before the next phase (rules.py)
        for u in units.values():
            for api, i in zip(u.apis, u.rules, strict=True):
                if APPLY_ORDER[api] == phase:
                    label = rule_label(i, rules[i]) if rules is not None else f"sharding.rules[{i}]"
                    _apply_one(api, modules[u.fqn], u, units, pick, label, compile_fallback)


def _apply_one(
    api: str, module: nn.Module, u: Unit, units: dict[str, Unit], pick: MeshPicker, label: str, fallback: bool
) -> None:
    opts = u.api_options.get(api, {})
    if api == "float8":
        from composerun.parallel.float8 import convert

        convert(module, opts, opts["all_gather"])
    elif api == "parallelize":
        from composerun.parallel.styles import parallelize

        parallelize(module, opts["styles"], pick.tp())
    elif api == "checkpoint":
        if opts["mode"] != "budget":  # (budget: the compiler's partitioner decides, set above)
            compiling.checkpoint_forward(module, opts)  # around the forward: eager, or traced by the compiler
    elif api == "compile":
        compiling.compile_module(module, opts, f"{label}: module {u.fqn or ROOT!r}", fallback)
    else:
        _apply_data_parallel(api, module, u, pick)


def _apply_data_parallel(api: str, module: nn.Module, u: Unit, pick: MeshPicker) -> None:
    o = u.options
    mp = MixedPrecisionPolicy(param_dtype=_dtype(o.get("param_dtype")), reduce_dtype=_dtype(o.get("reduce_dtype")))
    kwargs: dict[str, Any] = {"mesh": pick(u.mesh_dims), "mp_policy": mp}
    if api == "fully_shard":
        if o.get("reshard_after_forward") is not None:
            kwargs["reshard_after_forward"] = o["reshard_after_forward"]
        if o.get("offload"):
            # pin_memory needs an accelerator: a CPU build raises
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        fully_shard(module, **kwargs)
    else:
        compat.replicate(module, **kwargs)


def registered_as_planned(units: dict[str, Unit], fqn: str) -> list[str]:
    """The APIs torch's registry should show for a module: the data-parallel ones planned on
    it (activation checkpointing wraps the forward, compile too: no composable API)."""
    return [a for a in units[fqn].apis if a in DP_APIS] if fqn in units else []


def checkpoint_as_planned(units: dict[str, Unit], fqn: str) -> str | None:
    """The AC mode a module's forward should carry (budget is the compiler's: none)."""
    ac = units[fqn].api_options.get("checkpoint") if fqn in units else None
    return None if ac is None or ac["mode"] == "budget" else ac["mode"]


def verify_units(model: nn.Module, units: dict[str, Unit], rules: list[RuleConfig], require_coverage: bool) -> None:
    """Read torch's registry back: every planned API registered, nothing unplanned, and
    (when required) every parameter inside some data-parallel unit.  The APIs that are no
    composable API are checked where they live: a compiled forward, a checkpointed one."""
    for fqn, module in model.named_modules():
        got = compat.registered_apis(module)
        want = registered_as_planned(units, fqn)
        where = rule_label(units[fqn].rules[0], rules[units[fqn].rules[0]]) if fqn in units else "no rule"
        if sorted(got) != sorted(want):
            raise ConfigError(
                f"module {fqn or ROOT!r}: torch's registry shows {got or 'no API'} but {where} planned {want or 'none'}"
            )
        u = units.get(fqn)
        if u is not None and ("compile" in u.apis) != compiling.is_compiled(module):
            raise ConfigError(f"module {fqn or ROOT!r}: {where} planned compile, and its forward is not compiled")
        if compiling.checkpointed(module) != checkpoint_as_planned(units, fqn):
            raise ConfigError(
                f"module {fqn or ROOT!r}: {where} planned activation checkpointing "
                f"{checkpoint_as_planned(units, fqn) or 'none'}, and its forward has {compiling.checkpointed(module) or 'none'}"
            )
    if not require_coverage:
        return
    owned = [fqn for fqn, u in units.items() if any(a in DP_APIS for a in u.apis)]
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


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh's `tp` dim, or None."""
    names = list(mesh.mesh_dim_names or ())
    return None if TP_DIM not in names else MeshPicker(mesh).tp()


class MicroBatchSwitches:
    """FSDP's per-micro-batch switches for gradient accumulation (the training loop's, and
    the estimate's fake step's).  By default each fully_shard unit reduce-scatters every
    micro-batch and accumulates the shards; only HSDP's all-reduce over the replicate dim,
    and replicate's all-reduce, wait for the last one.  sharding.accumulate_unsharded keeps
    whole gradients until the last; sharding.reshard_after_backward=false keeps parameters
    unsharded between micro-batches (resharded before the optimizer step)."""

    def __init__(self, model: nn.Module, sharding: ShardingConfig, accum: int) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.model, self.sharding = model, sharding
        units = [m for m in model.modules() if isinstance(m, FSDPModule)] if accum > 1 else []
        self.shard_units = [m for m in units if "fully_shard" in compat.registered_apis(m)]
        self.other_units = [m for m in units if "fully_shard" not in compat.registered_apis(m)]

    def set(self, last: bool) -> None:
        """The switches for the next micro-batch (`last`: the step's last)."""
        for unit in self.shard_units:
            if self.sharding.accumulate_unsharded:
                unit.set_requires_gradient_sync(last, recurse=False)
            else:
                unit.set_requires_all_reduce(last, recurse=False)
            if not self.sharding.reshard_after_backward:
                unit.set_reshard_after_backward(last, recurse=False)
        for unit in self.other_units:
            unit.set_requires_gradient_sync(last, recurse=False)


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))


def apply_policy(
    model: nn.Module, sharding: ShardingConfig, mesh: DeviceMesh, compile_fallback: bool = False
) -> dict[str, Unit]:
    rules = effective_rules(sharding)
    units = assign_units(model, rules, mesh_sizes(mesh))
    apply_units(model, units, mesh, rules, compile_fallback)
    verify_units(model, units, rules, sharding.require_coverage)
    set_runtime_switches(model, sharding)
    return units


def loss_parallel(units: dict[str, Unit]) -> bool:
    """Whether the model's output is vocabulary-sharded logits (the loss under loss_parallel)."""
    return any(u.api_options.get("parallelize", {}).get("loss_parallel") for u in units.values())


def float8_all_gathers(units: dict[str, Unit]) -> bool:
    """Whether FSDP all-gathers float8 weights (whose scales are computed after each step)."""
    return any(u.api_options.get("float8", {}).get("all_gather") for u in units.values())


def loss_context(parallel: bool) -> Any:
    """Where the loss of vocabulary-sharded logits is computed, and its backward run: torch's
    loss_parallel() (the cross-entropy reduced over `tp` without gathering the logits)."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    return torch_loss_parallel() if parallel else nullcontext()


def misaligned_grads(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradient DTensor's backward placed unlike the parameter (tensor
    parallelism: a norm's gradient Partial over `tp`, a vocabulary-split embedding's Replicate)."""
    from torch.distributed.tensor import DTensor

    return [
        p
        for p in model.parameters()
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements
    ]


def align_grads(params: list[nn.Parameter]) -> None:
    """Give each gradient its parameter's placements: a sum over `tp` for a Partial one (an
    all-reduce), this rank's part of a Replicate one (no communication).  The optimizer, the
    clipping and the memory are then the parameter's (FSDP does the same for its units)."""
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss_parallel's is a DTensor replicated over `tp`)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
