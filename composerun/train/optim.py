"""Optimizer (any torch.optim class by `_target_`, AdamW by default) and the LR schedule.

The schedule is a pure function of (step, train.steps, optim): linear warmup, then cosine or
linear decay that reaches lr * min_lr_ratio exactly at the last step (index train.steps - 1).
Resuming needs no scheduler state: the LR is set from the step before each update (and a
resume that changes train.steps or the schedule says how the LR moves: train/resume.py).
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
        # the parameters that train: a frozen one (adapter=lora's base) gets no state (models/lora.py)
        return cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    except TypeError as e:
        key = _misfit_kwarg(cls, ocfg, e)
        if key is None:  # (an argument the class does not take names itself: "unexpected keyword 'nope'")
            raise ConfigError(f"optim._target_={ocfg._target_}: {e}") from None
        raise ConfigError(
            f"optim.kwargs.{key}={ocfg.kwargs[key]}: {e} (an argument of optim._target_={ocfg._target_})"
        ) from None


def _misfit_kwarg(cls: type, ocfg: OptimConfig, error: TypeError) -> str | None:
    """The optim.kwargs entry whose value the optimizer class cannot take (`betas=oops`: Python's
    TypeError names no argument), found by trying each one alone on one stand-in parameter."""
    if "unexpected keyword" in str(error):
        return None
    for key, value in ocfg.kwargs.items():
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], lr=ocfg.lr, weight_decay=ocfg.weight_decay, **{key: value})
        except TypeError:
            return key
        except Exception:  # noqa: BLE001 - another complaint (a ValueError) is not this error's
            continue
    return None


def lr_factor(step: int, total: int, ocfg: OptimConfig) -> float:
    """The LR of step index `step` (0-based) of a `total`-step run, as a fraction of optim.lr.

    Warmup: (step + 1) / (warmup + 1) for step < warmup, so the first step already moves and
    the full LR comes at the first step after warmup.  Then the decay's fraction goes from 0
    at step `warmup` to 1 at the last step, `total - 1`, which therefore trains at
    min_lr_ratio (a step past the end stays there)."""
    warm = ocfg.warmup_steps
    if step < warm:
        return (step + 1) / (warm + 1)
    kind = ocfg.schedule
    if kind == Schedule.constant:
        return 1.0
    frac = min(1.0, (step - warm) / max(1, total - 1 - warm))
    lo = ocfg.min_lr_ratio
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if kind == Schedule.cosine else 1 - frac
    return lo + (1 - lo) * shape


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, ocfg: OptimConfig) -> float:
    lr = ocfg.lr * lr_factor(step, total, ocfg)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr
