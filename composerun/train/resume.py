"""A resume trains with the config given, and says every way that config differs from the
checkpoint's.

- The optimizer: a checkpoint holds its param groups (lr, weight_decay, betas, eps, the
  class's other constructor arguments) beside its state, and loading them would train a
  resumed run with the checkpoint's hyper-parameters whatever the command line says.  From
  the checkpoint only the state (moments, step counts) is kept: after the load, every group's
  hyper-parameters are set back to what the optimizer was constructed with from this config.
- The config: every key that differs from the config in the checkpoint's manifest
  (config/typed.py's `config_changes`, whose list of keys not compared the launcher's line
  uses too) is one log line on rank 0 (`resume: optim.weight_decay 0.0 -> 0.5 (the config
  given is used)`); a new mesh or sharding policy is a reshard, a feature, and is said as info.
- The LR: it is a pure function of (step, train.steps, optim) (train/optim.py), so a resume
  that changes train.steps (extending a run) or the schedule moves it at once; the line
  `resume: the LR at step N changes from X (the checkpoint's schedule) to Y` says by how much.
  Steps are numbered as metrics.jsonl numbers them: N is the first step this run trains.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from composerun.checkpoint.checkpointer import Checkpointer
from composerun.checkpoint.manifest import read_manifest
from composerun.config.schema import Config, OptimConfig
from composerun.config.typed import config_changes, to_typed
from composerun.train.optim import lr_factor

log = logging.getLogger("composerun")

# The same training on another layout: DCP reshards model and optimizer state onto it.  Said
# as info; mixed precision (a dtype key) changes the numbers, so it is said as a warning.
LAYOUT = ("mesh", "sharding")
NUMERIC = ("param_dtype", "reduce_dtype")


def resume(ckpt: Checkpointer, optim: torch.optim.Optimizer, cfg: Config, path: Path | None) -> Path | None:
    """Load `path`, the checkpoint the launcher chose for this run (checkpoint/start.py; None:
    nothing to load), then put the config given back over what the load replaced; every
    difference from the checkpoint's config logged on rank 0.  The checkpoint resumed, or None."""
    if path is None:
        return None
    given = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    ckpt.load(path)
    keep_given_hyperparameters(optim, given)
    log.info("resumed from %s at step %d", path, ckpt.train.step)
    if dist.get_rank() == 0:
        before = read_manifest(path)
        for level, line in resume_lines(before, ckpt.meta, cfg, ckpt.train.step):
            log.log(level, "%s", line)
    return path


def keep_given_hyperparameters(optim: torch.optim.Optimizer, given: list[dict[str, Any]]) -> None:
    """Every param group's hyper-parameters as `given` (the groups as constructed, less their
    params): a loaded group's values are replaced, and keys the constructed optimizer does
    not have (another class's, in a checkpoint of another optimizer) are dropped.  The state
    is left as loaded, and so is the LR (`lr`), which no config sets directly: it is the
    schedule's at the checkpoint's last step, and each step sets it from the schedule again
    (a run resumed only to verify or export keeps the LR its last step trained with).
    (The load has checked that the number of groups is the same.)"""
    for group, want in zip(optim.param_groups, given, strict=True):
        params, lr = group["params"], group.get("lr", want.get("lr"))
        group.clear()
        group.update(want)
        group["params"] = params
        if "lr" in want:
            group["lr"] = lr


def resume_lines(manifest: dict[str, Any], meta: dict[str, Any], cfg: Config, step: int) -> list[tuple[int, str]]:
    """(log level, line) for each way this run's config (`meta`: this run's manifest fields)
    differs from the one in the manifest of the checkpoint it resumed at `step`."""
    if manifest.get("config_hash") == meta["config_hash"]:
        return []
    before = manifest.get("config")
    if not isinstance(before, dict):  # written by another tool, or by an older composerun
        return [
            (
                logging.WARNING,
                f"resume: the checkpoint's manifest holds no config to compare (config hash "
                f"{manifest.get('config_hash')}, this run's {meta['config_hash']}); the config given is used",
            )
        ]
    lines = config_differences(before, meta["config"])
    jump = lr_jump(before, cfg, step)
    return lines + ([(logging.WARNING, jump)] if jump else [])


def config_differences(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[int, str]]:
    """(log level, `resume: KEY OLD -> NEW (...)`) for every key `config_changes` finds."""
    out = []
    for change in config_changes(before, after):
        layout = _under(change.key, LAYOUT) and not change.key.endswith(NUMERIC)
        why = "the checkpoint is resharded onto it" if layout else "the config given is used"
        out.append((logging.INFO if layout else logging.WARNING, f"resume: {change} ({why})"))
    return out


def lr_jump(before: dict[str, Any], cfg: Config, step: int) -> str | None:
    """The line saying how the LR of the first step this run trains (index `step`) moves from
    the checkpoint's schedule to this config's, or None when it does not (or nothing trains)."""
    steps = cfg.train.steps
    if steps <= step:
        return None
    try:
        old_optim = to_typed(before["optim"], OptimConfig)
        old_steps = int(before["train"]["steps"])
    except (KeyError, TypeError, ValueError):  # a manifest of another schema: nothing to compare with
        return None
    old = old_optim.lr * lr_factor(step, old_steps, old_optim)
    new = cfg.optim.lr * lr_factor(step, steps, cfg.optim)
    if math.isclose(old, new, rel_tol=1e-12, abs_tol=0.0):
        return None
    return f"resume: the LR at step {step + 1} changes from {old:.6g} (the checkpoint's schedule) to {new:.6g}"


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)
