"""What a checkpoint holds: Stateful objects under fixed keys (`model`, `optim`, `train`,
`rng`), and what loading an optimizer's state needs from torch's state-dict utilities."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from composerun.models.lora import frozen_names


class ModelState(Stateful):
    """The model's state dict, less its frozen parameters (an adapter run's base, read again from
    where it came from: checkpoint/adapters.py)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.frozen = frozen_names(model)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in get_model_state_dict(self.model).items() if k not in self.frozen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=not self.frozen))


class OptimState(Stateful):
    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, optim_state_for_load(self.model, sd))


def optim_state_for_load(model: torch.nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as torch's set_optimizer_state_dict asks for it.

    For a parameter that a module's `_fqn_modifiers` renames (FusionEmbeddingWithModifier:
    `embedding.weight` is `weight` in the state dict), torch 2.13's get_optimizer_state_dict
    keys its state by the parameter's name, while set_optimizer_state_dict asks for the
    renamed key and refuses the load without it (and strict=False would drop that state).  The
    same state goes under the key the loader asks for."""
    loader = {id(p): fqn for fqn, p in _modified_names(model)}
    renamed = {n: loader[id(p)] for n, p in model.named_parameters() if loader.get(id(p), n) != n}
    if not renamed or not any(k in osd["state"] for k in renamed):
        return osd
    return {
        **osd,
        "state": {renamed.get(k, k): v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [renamed.get(n, n) for n in g["params"]]} for g in osd["param_groups"]],
    }


def _modified_names(module: torch.nn.Module, prefix: str = "", seen: set | None = None):
    """(name, parameter) as torch's state-dict utilities name them on load: a child that its
    parent lists in `_fqn_modifiers()` adds no name of its own (torch's traversal)."""
    seen = set() if seen is None else seen
    seen.add(module)
    modifiers = set(module._fqn_modifiers().values()) if hasattr(module, "_fqn_modifiers") else set()
    for name, child in module.named_children():
        if child not in seen:
            yield from _modified_names(child, prefix if name in modifiers else f"{prefix}{name}.", seen)
    for name, p in module.named_parameters(recurse=False):
        yield f"{prefix}{name}", p


class TrainState(Stateful):
    """Step and samples consumed, as tensors so that nothing here is pickled."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.samples)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples = int(sd["step"]), int(sd["samples"])


class RNGState(Stateful):
    """This rank's RNG state, under a key of its own so that DCP keeps every rank's copy."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        sd = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return {self.key: sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd[self.key]["cpu"])
        if "cuda" in sd[self.key]:
            torch.cuda.set_rng_state(sd[self.key]["cuda"])


def prepare_state_for_load(opt: torch.optim.Optimizer) -> bool:
    """Give an Adam/AdamW with no state yet its state tensors, NaN-filled, for a checkpoint
    load to fill.  Without this, torch's state-dict utilities create the state by running a
    whole optimizer step on zero gradients (zero-filling the gradients and both moments,
    then the arithmetic), and the load overwrites every value (BENCHMARKS.md: what this
    takes off a load).  The layout is what Adam's first step
    creates (keys, shapes, dtypes, devices, DTensor placements; tests/test_optim.py pins it
    against the utilities' own), so DCP's strict load still fails on a checkpoint that lacks
    any of it.  Other optimizers (and Adam subclasses, whose state may differ) keep the
    utilities' way.  Returns whether it did anything.

    The NaN is the first touch of the state's memory, done here, while a resume's prefetch
    has the disk read the checkpoint, rather than by the load's copies after it (a faster
    cold resume: BENCHMARKS.md).  Deterministic mode fills new tensors with NaN
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
