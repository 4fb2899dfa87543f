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
    from hydra.utils import get_class

    try:
        cls = get_class(ocfg["_target_"])
    except Exception as e:
        raise ConfigError(f"optim._target_={ocfg['_target_']}: cannot import it ({e.__class__.__name__})") from None
    kwargs = {"lr": ocfg["lr"], "weight_decay": ocfg["weight_decay"], **(ocfg.get("kwargs") or {})}
    try:
        return cls(model.parameters(), **kwargs)
    except TypeError as e:
        raise ConfigError(f"optim._target_={ocfg['_target_']}: {e}") from None


def prepare_state_for_load(opt: torch.optim.Optimizer) -> bool:
    """Give an Adam/AdamW with no state yet its state tensors, uninitialised, for a checkpoint
    load to fill.  Without this, torch's state-dict utilities create the state by running a
    whole optimizer step on zero gradients (zero-filling the gradients and both moments,
    then the arithmetic), and the load overwrites every value: on a 1.5 GiB state this
    took 0.45-0.5 s off each load here (BENCHMARKS.md).  The layout is what Adam's first step
    creates (keys, shapes, dtypes, devices, DTensor placements; tests/test_optim.py pins it
    against the utilities' own), so DCP's strict load still fails on a checkpoint that lacks
    any of it.  Other optimizers (and Adam subclasses, whose state may differ) keep the
    utilities' way.  Returns whether it did anything."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state:
        return False
    if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return False  # the utilities leave such an optimizer alone too: keep their behaviour
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
