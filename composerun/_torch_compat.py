"""Every use of torch's private distributed APIs, in one place.

These helpers have moved and changed meaning between torch releases (PITFALLS §6.2), so
composerun reaches them only through this module: a torch upgrade breaks here, once,
with one clear message, and tests/test_registry.py pins the behaviour relied on.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch
import torch.nn as nn

TESTED = ((2, 13), (2, 14))  # [lower, upper) of torch versions this module was checked against


class ComposerunTorchCompatError(ImportError):
    pass


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _require(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ComposerunTorchCompatError(
            f"composerun needs {module}.{name}, which torch {torch.__version__} lacks "
            f"(tested with torch {TESTED[0][0]}.{TESTED[0][1]}): {e}"
        ) from None


if not (TESTED[0] <= _version() < TESTED[1]):
    warnings.warn(
        f"composerun was tested with torch {TESTED[0][0]}.{TESTED[0][1]}; found {torch.__version__}",
        stacklevel=2,
    )

_get_module_state = _require("torch.distributed._composable_state", "_get_module_state")
_get_registry = _require("torch.distributed._composable.contract", "_get_registry")

# FSDP2-family replicate (DTensor params, MixedPrecisionPolicy, 1-D mesh); the older
# DDP-based torch.distributed._composable.replicate is not used (PITFALLS §4.2).
replicate = _require("torch.distributed._composable.replicate_with_fsdp", "replicate")
# Composable activation checkpointing keeps FQNs, unlike checkpoint_wrapper.
checkpoint = _require("torch.distributed._composable.checkpoint_activation", "checkpoint")
# Sees every op a forward on meta tensors runs (the launcher's check of the model and data).
TorchDispatchMode = _require("torch.utils._python_dispatch", "TorchDispatchMode")


def registered_apis(module: nn.Module) -> list[str]:
    """Names of the composable APIs applied to `module`, in the order applied."""
    return list(_get_registry(module) or {})


def module_state_name(module: nn.Module) -> str | None:
    """Class name of the composable state torch keeps for `module` (FSDPState, ...)."""
    state = _get_module_state(module)
    return None if state is None else type(state).__name__


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch's fake process group as the default group: collectives are no-ops, so one
    process can apply a policy as any rank of any mesh (PITFALLS §5).  Its store lives in
    torch's private testing package."""
    import torch.distributed as dist

    fake_store = _require("torch.testing._internal.distributed.fake_pg", "FakeStore")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())
