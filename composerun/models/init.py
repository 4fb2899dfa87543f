"""A model's initial weights, made where they are needed: each rank holds only its shards.

The model is built on the meta device (structure, no memory), the policy shards it there,
and `materialize` then allocates each rank's part on the training device and fills it.
Each module that holds parameters or buffers of its own is initialized by its own
`reset_parameters()` (torch's convention for layers, and what torch's meta-device docs ask
of a model) on a full-size copy of just those tensors, from the run's seed, in
`named_modules` order; each rank keeps its chunk of each.  So the initial weights are the
same on every mesh (they never depend on the sharding), and the most any rank holds beyond
its shards is one module's own tensors (an embedding table, say), never the whole model.

A model that cannot be made this way is built whole on the training device from the seed
instead (its constructor's initialization), as before meta-device building, and the log
says why: a module with tensors of its own but no `reset_parameters()`, tensors or modules
held outside torch's registry (a plain attribute or list: the meta device would keep
them), or a `reset_parameters()` that leaves some of its tensors unset (found while
materializing: each rank then copies its chunks from a whole host copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from composerun.config.schema import AdapterConfig, ModelConfig
from composerun.models import build_model, hf_causal
from composerun.models.lora import init_adapters

log = logging.getLogger("composerun")


def build_on_meta(mcfg: ModelConfig, adapter: AdapterConfig | None = None, seed: int = 0) -> nn.Module:
    """The configured model (with its adapters) on the meta device: its structure, no memory."""
    with torch.device("meta"):
        return build_model(mcfg, adapter, seed)


def build(
    mcfg: ModelConfig, seed: int, device: torch.device, offload: bool = False, adapter: AdapterConfig | None = None
) -> tuple[nn.Module, bool]:
    """The model to shard, and whether it is on the meta device (then `materialize` it after
    sharding); else built whole on `device` from `seed`.  `offload`: a rule offloads
    parameters to the CPU, which FSDP wants there when it shards them (built whole).
    `adapter`: cfg.adapter, the adapters it adds (models/lora.py)."""
    model = build_on_meta(mcfg, adapter, seed)
    if hf_causal.is_hf(model):  # transformers' modules: allocated, their weights read from files
        return model, True
    why = "a sharding rule offloads parameters to the CPU" if offload and device.type != "cpu" else None
    why = why or why_not_on_meta(model)
    if why is None:
        return model, True
    log.info("model: built whole on every rank (%s); %s", why, _HOW)
    torch.manual_seed(seed)
    return build_model(mcfg, adapter, seed).to(device), False


_HOW = (
    "to build only each rank's shards, give each module with parameters or buffers of its own a "
    "reset_parameters() that sets them all, and register every tensor and module"
)


def why_not_on_meta(model: nn.Module) -> str | None:
    """Why `model` (built on meta) cannot be materialized module by module; None if it can."""
    for what, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
        if len(list(named(remove_duplicate=False))) != len(list(named())):
            return f"a {what} is shared by several modules (tied weights)"
    registered = set(model.modules())
    for fqn, m in model.named_modules():
        if _own_tensors(m) and not hasattr(m, "reset_parameters"):
            return f"module {fqn or type(m).__name__!r} has no reset_parameters()"
        for attr, value in vars(m).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, torch.Tensor) or (isinstance(v, nn.Module) and v not in registered):
                    where = f"{fqn}.{attr}" if fqn else attr
                    return f"{where} is a {type(v).__name__} outside torch's registry"
    return None


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _unfilled(t: torch.Tensor) -> torch.Tensor:
    """`t` set to a value an initialization never leaves: NaN, or an integer's largest."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)
    return t


def _is_unfilled(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return t.dtype != torch.bool and bool((t == torch.iinfo(t.dtype).max).all()) and t.numel() > 0


def _copy_chunk(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of the full tensor `full` into `dst` (a DTensor or a plain tensor)."""
    with torch.no_grad():
        if isinstance(dst, DTensor):
            # src_data_rank=None: each rank cuts its own chunk of its own copy, no communication
            mine = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
            dst.to_local().copy_(mine)
        else:
            dst.copy_(full)


def _full_shadow(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Full-size, unfilled tensors of the same shapes and dtypes, on `device`."""
    return {n: _unfilled(torch.empty(t.shape, dtype=t.dtype, device=device)) for n, t in tensors.items()}


def _reset_on_shadow(module: nn.Module, shadow: dict[str, torch.Tensor]) -> bool:
    """Run `module.reset_parameters()` on `shadow` in place of its own tensors; whether it
    filled every one of them."""
    saved = _own_tensors(module)
    params = dict(module.named_parameters(recurse=False))
    try:
        for n, t in shadow.items():
            setattr(module, n, nn.Parameter(t, requires_grad=params[n].requires_grad) if n in params else t)
        with torch.no_grad():
            module.reset_parameters()
        for n in shadow:  # a reset may assign new tensors rather than fill in place
            shadow[n] = getattr(module, n).detach()
    except Exception as e:  # noqa: BLE001 - any failure means: initialize from the host model instead
        log.debug("reset_parameters of %s failed on its full-size copy: %s", type(module).__name__, e)
        return False
    finally:
        for n, t in saved.items():
            setattr(module, n, t)
    return not any(_is_unfilled(t) for t in shadow.values())


def materialize(model: nn.Module, device: torch.device, seed: int, build_host: Callable[[], nn.Module]) -> str:
    """Allocate `model` (built on meta by `build`, sharded or not) on `device` and
    initialize it from `seed`; `build_host` builds the whole model, for a module whose
    reset_parameters() turns out not to set all its tensors.  Returns how: "reset_parameters"
    or "host"; or "pretrained" for a transformers model (models/hf_causal.py), allocated with
    its non-persistent buffers and left for its pretrained files to fill."""
    if hf_causal.is_hf(model):
        hf_causal.materialize(model, device)
        init_adapters(model)  # (the base's tensors are left for the files; the adapters' are not in them)
        return "pretrained"
    owners = [(fqn, m) for fqn, m in model.named_modules() if _own_tensors(m)]
    model.to_empty(device=device)
    torch.manual_seed(seed)
    for fqn, module in owners:
        tensors = _own_tensors(module)
        shadow = _full_shadow(tensors, device)
        if not _reset_on_shadow(module, shadow):
            log.info("model: built whole to initialize it (%s's reset_parameters() left tensors unset); %s", fqn, _HOW)
            break
        for n, t in tensors.items():
            _copy_chunk(t, shadow[n])
        del shadow
    else:
        return "reset_parameters"
    torch.manual_seed(seed)
    host = build_host()
    full = {**dict(host.named_parameters()), **dict(host.named_buffers())}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        _copy_chunk(t, full[name].to(device))
    return "host"
