"""Optimizer (any torch.optim class by `_target_`, AdamW by default) and the LR schedule.

The schedule is a pure function of the step (linear warmup, then cosine/linear decay to
min_lr_ratio), so resuming needs no scheduler state: the LR is set from the step before each update.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from composerun.errors import ConfigError


def build_optimizer(model: torch.nn.Module, ocfg: Any) -> torch.optim.Optimizer:
    from composerun.config import target_class

    cls = target_class("optim._target_", ocfg["_target_"])
    kwargs = {"lr": ocfg["lr"], "weight_decay": ocfg["weight_decay"], **(ocfg.get("kwargs") or {})}
    try:
        return cls(model.parameters(), **kwargs)
    except TypeError as e:
        raise ConfigError(f"optim._target_={ocfg['_target_']}: {e}") from None


def prepare_state_for_load(opt: torch.optim.Optimizer) -> bool:
    """Give an Adam/AdamW with no state yet its state tensors, NaN-filled, for a checkpoint
    load to fill.  Without this, torch's state-dict utilities create the state by running a
    whole optimizer step on zero gradients (zero-filling the gradients and both moments,
    then the arithmetic), and the load overwrites every value: on a 1.5 GiB state this
    took 0.45-0.5 s off each load here (BENCHMARKS.md).  The layout is what Adam's first step
    creates (keys, shapes, dtypes, devices, DTensor placements; tests/test_optim.py pins it
    against the utilities' own), so DCP's strict load still fails on a checkpoint that lacks
    any of it.  Other optimizers (and Adam subclasses, whose state may differ) keep the
    utilities' way.  Returns whether it did anything.

    The NaN is the first touch of the state's memory, done here, while a resume's prefetch
    has the disk read the checkpoint, rather than by the load's copies after it: cold
    resumes of the 1.5 GiB state took 0.84-0.99 s with it against 1.01-1.21 s without
    (6 alternating runs each, BENCHMARKS.md).  Deterministic mode fills new tensors with NaN
    already (torch.utils.deterministic.fill_uninitialized_memory): not twice, then."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state:
        return False
    if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return False  # the utilities leave such an optimizer alone too: keep their behaviour
    filled = torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    for group in opt.param_groups:
        on_param = group["capturable"] or group["fused"]
        step_dtype = (
            torch.float64 if torch.get_default_dtype() == torch.float64 and not group["fused"] else torch.float32
        )
        for p in group["params"]:
            if not p.requires_grad:
                continue  # its gradient is never set, so Adam never makes state for it
            state = {"step": torch.zeros((), dtype=step_dtype, device=p.device if on_param else "cpu")}
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                state[key] = torch.empty_like(p, memory_format=torch.preserve_format)
                if not filled:
                    state[key].fill_(float("nan"))
            opt.state[p] = state
    return True


def lr_factor(step: int, total: int, ocfg: Any) -> float:
    warm = ocfg["warmup_steps"]
    if step < warm:
        return (step + 1) / (warm + 1)
    kind = str(getattr(ocfg["schedule"], "value", ocfg["schedule"]))
    if kind == "constant" or total <= warm:
        return 1.0
    frac = min(1.0, (step - warm) / max(1, total - warm))
    lo = ocfg["min_lr_ratio"]
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1 - frac
    return lo + (1 - lo) * shape


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, ocfg: Any) -> float:
    lr = ocfg["lr"] * lr_factor(step, total, ocfg)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


# --- the gradient norm: reduced in the step's one all-reduce ----------------------------------


class GradNorm:
    """The global 2-norm of the gradients, for clipping and the log, reduced in the step's
    one all-reduce (beside the loss and the stop flag) instead of one of its own.

    Under fully_shard every rank holds a shard of each gradient.  torch's norm of such
    DTensors (clip_grad_norm_) takes each gradient's norm over this rank's shard, squares
    them, all-reduces the vector of squares, takes their square roots and then the norm of
    those.  Here the vector of squares rides the step's all-reduce, and the rest is the same
    float operations in the same order: the norm is torch's, bit for bit.  On mesh dims
    where gradients are replicated (HSDP's replicate dim) only the ranks at coordinate 0
    add theirs (the others add zeros).  Where no gradient is sharded (one rank, `replicate`
    alone) the local norm is the global one and nothing is reduced; gradients of another
    layout (a mesh that is not every rank, several meshes or dtypes) are reduced on their
    own, as torch does.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], dtype: torch.dtype = torch.float32, device: torch.device | None = None
    ) -> None:
        """`dtype`, `device`: those of the all-reduce the shares ride in (gradients of another
        dtype, or on another device, as with CPU offload on a GPU, are reduced on their own,
        as torch does); the norm is returned on `device`."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.params, self.device = params, torch.device(device or "cpu")
        grads = [p.grad for p in params]
        self.mode, self.owner = "separate", True
        if not grads or not any(isinstance(g, DTensor) for g in grads):
            self.mode = "local"
            return
        if not all(isinstance(g, DTensor) for g in grads):
            return
        mesh, placements = grads[0].device_mesh, grads[0].placements
        if any(g.device_mesh != mesh or g.placements != placements or g.dtype != dtype for g in grads):
            return
        if any(g.device != self.device for g in grads):
            return
        if not all(isinstance(p, (Shard, Replicate)) for p in placements):
            return
        if not any(isinstance(p, Shard) for p in placements):
            self.mode = "local"
            return
        import torch.distributed as dist

        if mesh.size() != dist.get_world_size():
            return
        self.mode = "fused"
        coordinate = mesh.get_coordinate() or []
        self.owner = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))

    def covers(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether these are the parameters (those with gradients) it was made for."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params, strict=True))

    def shares(self) -> torch.Tensor | None:
        """This rank's terms of the step's all-reduce: each gradient's squared norm over this
        rank's shard (None: the norm is not reduced there)."""
        if self.mode != "fused":
            return None
        squares = torch.stack(torch._foreach_norm([p.grad.to_local() for p in self.params], 2.0)) ** 2.0
        return squares if self.owner else torch.zeros_like(squares)

    def total(self, reduced: torch.Tensor | None) -> torch.Tensor:
        """The global norm, from the all-reduced shares (or reduced here, or local)."""
        if self.mode == "fused":
            assert reduced is not None
            return torch.linalg.vector_norm(reduced ** (1.0 / 2.0), 2.0)
        from torch.distributed.tensor import DTensor, Replicate

        if not self.params:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params], 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.redistribute(placements=[Replicate()] * norm.device_mesh.ndim).to_local()
        return norm.to(self.device)

    def clip_(self, max_norm: float, norm: torch.Tensor) -> None:
        """Scale the gradients to a global norm of at most max_norm (0: leave them)."""
        if max_norm > 0 and self.params:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm, foreach=True)
