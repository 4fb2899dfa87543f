"""Optimizer (any torch.optim class by `_target_`, AdamW by default) and the LR schedule.

The schedule is a pure function of the step (linear warmup, then cosine/linear decay to
min_lr_ratio), so resuming needs no scheduler state: the LR is set from the step before each update.
"""

from __future__ import annotations

import math

import torch

from composerun.config.schema import OptimConfig, Schedule, target_class
from composerun.errors import ConfigError


def build_optimizer(model: torch.nn.Module, ocfg: OptimConfig) -> torch.optim.Optimizer:
    cls = target_class("optim._target_", ocfg._target_)
    kwargs = {"lr": ocfg.lr, "weight_decay": ocfg.weight_decay, **ocfg.kwargs}
    try:
        return cls(model.parameters(), **kwargs)
    except TypeError as e:
        raise ConfigError(f"optim._target_={ocfg._target_}: {e}") from None


def lr_factor(step: int, total: int, ocfg: OptimConfig) -> float:
    warm = ocfg.warmup_steps
    if step < warm:
        return (step + 1) / (warm + 1)
    kind = ocfg.schedule
    if kind == Schedule.constant or total <= warm:
        return 1.0
    frac = min(1.0, (step - warm) / max(1, total - warm))
    lo = ocfg.min_lr_ratio
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if kind == Schedule.cosine else 1 - frac
    return lo + (1 - lo) * shape


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, ocfg: OptimConfig) -> float:
    lr = ocfg.lr * lr_factor(step, total, ocfg)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr
