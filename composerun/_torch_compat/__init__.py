"""Every use of torch's private distributed APIs, in one place (this package: the checkpoint
files' private parts in dcp.py, the pre-flight estimate's tools in tools.py).

These helpers have moved and changed meaning between torch releases, so composerun
reaches them only through this module: a torch upgrade breaks here, once, with one clear
message, and tests/test_registry.py pins the behaviour relied on.  So do the checkpoint
files' undocumented parts composerun relies on (DCP's writer's file system, its per-item
storage records, torch.save's zip layout and CRC-32 switch, what DCP pickles into
`.metadata`): dcp.py, pinned by tests/test_compat.py.  Where the tested releases (TESTED:
2.11 to 2.14) differ, the helper says which does what, and tests/test_torch_versions.py
checks the older behaviour on the installed torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from composerun._torch_compat._base import TESTED, ComposerunTorchCompatError, _require, _version, tested  # noqa: F401

_get_module_state = _require("torch.distributed._composable_state", "_get_module_state")
_get_registry = _require("torch.distributed._composable.contract", "_get_registry")

# FSDP2-family replicate (DTensor params, MixedPrecisionPolicy, 1-D mesh); the older
# DDP-based torch.distributed._composable.replicate is not used (it keeps no DTensors).
replicate = _require("torch.distributed._composable.replicate_with_fsdp", "replicate")
# Sees every op a forward on meta tensors runs (the launcher's check of the model and data).
TorchDispatchMode = _require("torch.utils._python_dispatch", "TorchDispatchMode")
# Each tensor's norm in one kernel, as torch's clip_grad_norm_ takes them (the grad norm's shares).
foreach_norm = _require("torch", "_foreach_norm")


def flatten_mesh(mesh: Any, name: str) -> Any:  # (name: one no mesh dim of the user's can have)
    """A 1-D mesh over every rank of `mesh` (a sub-mesh of several dims), made from it: its
    groups are derived from the root mesh's, so FSDP over it composes with tensor parallelism
    over the root's other dims.  DeviceMesh._flatten has no public name (torch 2.11 to 2.14)."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise ComposerunTorchCompatError(
            f"composerun flattens mesh dims with DeviceMesh._flatten, which torch {torch.__version__} lacks "
            f"(tested with torch {tested()})"
        )
    return flatten(name)


def set_activation_memory_budget(budget: float) -> None:
    """The compiler's activation-memory budget (checkpoint mode budget): 0 recomputes what it
    can, 1 keeps everything (torch's default).  A process-wide setting of torch._functorch."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "activation_memory_budget"):
        raise ComposerunTorchCompatError(
            f"checkpoint mode budget sets torch._functorch.config.activation_memory_budget, which torch "
            f"{torch.__version__} lacks (tested with torch {tested()})"
        )
    functorch_config.activation_memory_budget = budget


def elastic_launch_config(**kwargs: Any) -> Any:
    """torch's elastic LaunchConfig (torch.distributed.launcher.api) of `kwargs`.  Its
    `shutdown_timeout` (how long the agent waits for the ranks after forwarding a signal, then
    SIGKILL) first ships in torch 2.12: torch 2.11's agent always waits 30 s, so there the option
    is left out, with a warning when another time was asked for."""
    from torch.distributed.launcher import api as launcher

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(launcher.LaunchConfig)}:
        timeout = kwargs.pop("shutdown_timeout", None)
        if timeout is not None and timeout != 30:
            logging.getLogger("composerun").warning(
                "launch.shutdown_timeout=%s does nothing on torch %s: its elastic agent waits 30 s for the ranks "
                "after a signal (torch 2.12 and later take the option)",
                timeout,
                torch.__version__,
            )
    return launcher.LaunchConfig(**kwargs)


def quiet_rendezvous_names() -> None:
    """torch's dynamic rendezvous (torch.distributed.elastic.rendezvous.dynamic_rendezvous, in
    2.11 to 2.14) names every event it may record after the method that records it, through its
    `get_method_name`, which calls inspect.stack() twice: that reads the source file of every
    frame on the stack, and the name is computed even when no handler records the event (the
    default).  Under Hydra's deep stack that was most of the launching process's CPU in the
    rendezvous.  The same name, read off the frame itself, replaces it (idempotent)."""
    module = importlib.import_module("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    _require(module.__name__, "get_method_name")

    def get_method_name(depth: int = 2) -> str:
        try:  # frame 0 is this function's, as inspect.stack()[0] is
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a stack shallower than `depth`
            return "no_method_name"

    module.get_method_name = get_method_name


def stager_stages_once() -> bool:
    """Whether DCP's DefaultStager copies one state only: torch 2.11's and 2.12's close their
    state-dict stager at the end of every stage(), which clears the table its deep copy
    dispatches on (the next stage() fails: `KeyError: <class 'type'>`) and the buffers it
    would reuse; torch 2.13 keeps both for the next save.  No attribute tells, so the version."""
    return _version() < (2, 13)


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (dynamo's counter of
    unique graphs: a recompilation is one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_runs_eagerly() -> bool:
    """Whether torch.compile would run no compiled frame here: under a torch dispatch mode not
    its own (the memory tracker's, say) dynamo skips every frame, and with fullgraph raises
    ("found no compiled frames").  Its own test: the modes on the stack (torch 2.13's default),
    else its flag for any mode entered."""
    import torch._dynamo.config as dynamo_config
    from torch.utils import _python_dispatch as dispatch

    if getattr(dynamo_config, "inline_torch_dispatch_torch_compile", False):
        return dispatch.any_torch_dispatch_mode_on_stack()
    flag = getattr(dispatch, "is_in_any_mode_without_ignore_compile_internals", None)
    return flag() if flag is not None else dispatch.is_in_torch_dispatch_mode(include_infra_modes=False)


def is_compile_error(e: BaseException) -> bool:
    """Whether `e` is torch.compile's failure to compile (dynamo, a backend, inductor), as
    opposed to an error the compiled code raised as eager code would."""
    import torch._dynamo.exc as dynamo_exc

    if isinstance(e, dynamo_exc.BackendCompilerFailed | dynamo_exc.Unsupported | dynamo_exc.UserError):
        return True
    inductor_error = getattr(importlib.import_module("torch._inductor.exc"), "InductorError", None)
    return inductor_error is not None and isinstance(e, inductor_error)


# DTensor's collectives (tensor parallelism's redistributions, loss_parallel's reductions) are
# functions of torch.distributed._functional_collectives, looked up on the module at every call
# (tensor/_collective_utils.py, placement_types.py, parallel/loss.py).  Their names changed:
# torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single, and its DTensor calls the new names; the old ones stay as deprecated
# wrappers that call the new ones.  torch 2.11 and 2.12's DTensor calls the old names, and they
# have no new ones.  Every spelling present is wrapped, and only the outermost call records
# (below): an alias of one name to the other would miss the calls of whichever spelling DTensor
# makes.
_FUNCTIONAL_COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_reduce": ("all_reduce",),
}


def functional_collective_names() -> dict[str, list[str]]:
    """{kind: the names this torch's functional collectives have for it}: every spelling of
    _FUNCTIONAL_COLLECTIVES present, at least one per kind."""
    funcol = importlib.import_module("torch.distributed._functional_collectives")
    out = {
        kind: [n for n in names if callable(getattr(funcol, n, None))]
        for kind, names in _FUNCTIONAL_COLLECTIVES.items()
    }
    for kind, names in out.items():
        if not names:
            raise ComposerunTorchCompatError(
                f"composerun records tensor parallelism's {kind} through torch.distributed._functional_collectives."
                f"{' or '.join(_FUNCTIONAL_COLLECTIVES[kind])}, which torch {torch.__version__} lacks "
                f"(tested with torch {tested()})"
            )
    return out


@contextmanager
def recording_functional_collectives(record: Any) -> Iterator[None]:
    """Call `record(kind, tensor)` with the input of every all-gather, reduce-scatter and
    all-reduce of torch's functional collectives this process issues inside, in this thread or
    any: the collectives of tensor parallelism's styles and loss_parallel (parallel/tp_comm.py),
    whichever of its names (functional_collective_names) the installed DTensor calls.  One
    collective is recorded once: a call made from inside a recorded call (a deprecated name
    calling its successor) is not recorded again.  (A Shard-to-Shard redistribution's
    all-to-all, which composerun's styles do not make, is not recorded.)"""
    funcol = importlib.import_module("torch.distributed._functional_collectives")
    names = functional_collective_names()
    saved = {name: getattr(funcol, name) for kind in names for name in names[kind]}
    inside = threading.local()  # per thread: another thread's collective is its own outermost call

    def wrap(kind: str, fn: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "depth", 0) == 0:
                record(kind, tensor)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return fn(tensor, *args, **kwargs)
            finally:
                inside.depth -= 1

        return call

    try:
        for kind in names:
            for name in names[kind]:
                setattr(funcol, name, wrap(kind, saved[name]))
        yield
    finally:
        for name, fn in saved.items():
            setattr(funcol, name, fn)


def shards(placement: Any) -> bool:
    """Whether a DTensor placement splits the tensor: Shard, or the _StridedShard that FSDP
    gives a dim tensor parallelism already split (torch 2.11 to 2.14: no Shard subclass, and private)."""
    from torch.distributed.tensor import Shard

    strided = getattr(importlib.import_module("torch.distributed.tensor.placement_types"), "_StridedShard", ())
    return isinstance(placement, (Shard, strided))


def registered_apis(module: nn.Module) -> list[str]:
    """Names of the composable APIs applied to `module`, in the order applied."""
    return list(_get_registry(module) or {})


def module_state_name(module: nn.Module) -> str | None:
    """Class name of the composable state torch keeps for `module` (FSDPState, ...)."""
    state = _get_module_state(module)
    return None if state is None else type(state).__name__


def fsdp_offload_policy(module: nn.Module) -> Any:
    """The OffloadPolicy fully_shard keeps for `module`'s own parameters (CPUOffloadPolicy:
    their shards live on the CPU), or None (not a fully_shard unit, or none of its own).
    torch has no public getter; its FSDP state's parameter group holds it."""
    group = getattr(_get_module_state(module), "_fsdp_param_group", None)
    return None if group is None else group.offload_policy


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch's fake process group as the default group: collectives are no-ops, so one
    process can apply a policy as any rank of any mesh.  Its store lives in
    torch's private testing package."""
    import torch.distributed as dist

    fake_store = _require("torch.testing._internal.distributed.fake_pg", "FakeStore")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())


def held_gradient_elements(model: nn.Module) -> int:
    """Gradient elements this rank holds now: its parameters' gradients (local shards), and
    the whole gradients FSDP keeps between the micro-batches whose reduce-scatter is deferred
    (an FSDPParam's unsharded parameter's `.grad`, or its `unsharded_accumulated_grad` in
    reduce_dtype).  For tests and the memory benchmark of gradient accumulation."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    held = 0
    for p in model.parameters():
        if p.grad is not None:
            held += (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).numel()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else []:
            if fp.unsharded_accumulated_grad is not None:
                held += fp.unsharded_accumulated_grad.numel()
            elif hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None:
                held += fp._unsharded_param.grad.numel()
    return held


def default_store() -> Any:
    """The default process group's store, which every rank reaches
    (torch.distributed.distributed_c10d._get_default_store: private in torch 2.11 to 2.14)."""
    return _require("torch.distributed.distributed_c10d", "_get_default_store")()


def shutdown_loader_workers(batches: Any, grace: float = 5.0) -> None:
    """End a DataLoader iterator's worker processes now (composerun/data/loader.py), whatever
    still refers to the iterator (a traceback through its __next__ keeps it from being
    deleted, and so from shutting its workers down): the DataLoader's own shutdown (the
    end signal, a join of 5 s each, then SIGTERM, which composerun's workers ignore), then
    SIGKILL and a join for a worker still alive, so that no process is left for
    multiprocessing's exit handler to wait for.  A single-process iterator has no workers."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is None:
        return
    shutdown()
    for worker in getattr(batches, "_workers", []):
        if worker.is_alive():
            worker.kill()
        worker.join(grace)


# The checkpoint files' private parts and the estimate's tools live beside this module (same
# package, same rule: every private torch API composerun uses is in composerun/_torch_compat/).
from composerun._torch_compat.dcp import (  # noqa: E402, F401 - re-exported
    ItemLocation,
    item_locations,
    load_dcp_metadata,
    no_zip_crc32,
    tensor_record_offset,
    use_file_system,
)
from composerun._torch_compat.tools import (  # noqa: E402, F401 - re-exported
    analyzer_reads_gloo,
    compile_backward_eagerly,
    dump_memory_snapshot,
    fake_tensor_failure,
    fake_tensor_mode,
    flight_recorder_dump,
    flop_formulas,
    is_fake,
    memory_tracker,
    next_iteration,
    post_backward_snapshots,
    record_memory_history,
)
