"""The pre-flight estimate's tools (parallel/estimate.py, train/memory.py): torch's fake tensors,
its memory trackers (torch.distributed._tools), its table of FLOP formulas per op, and the
compiler's switch for lowering a backward early; the CUDA allocator's history and snapshot
(train/profile.py: profile.memory_snapshot); and the flight recorder's dump of the collectives
(train/flight_recorder.py: profile.flight_recorder)."""

from __future__ import annotations

import functools
import importlib
import pickle
from typing import Any

import torch
import torch.nn as nn

from composerun._torch_compat._base import _require, _version


def fake_tensor_mode() -> Any:
    """A FakeTensorMode that also takes the meta model's real-looking inputs (tensors made
    outside it are converted)."""
    mode = _require("torch._subclasses.fake_tensor", "FakeTensorMode")
    return mode(allow_non_fake_inputs=True)


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a fake tensor (shapes and dtypes only: the estimate's)."""
    return bool(_require("torch._subclasses.fake_tensor", "is_fake")(t))


def memory_tracker(model: nn.Module, optim: Any = None) -> Any:
    """torch's FSDPMemTracker for a model whose root is an FSDP (or replicate) unit, its
    MemTracker (watching the model) for any other; either a context manager whose
    get_tracker_snapshot("peak") gives {device: {category: bytes, "Total": bytes}}.  With
    `optim`, its state is tracked too."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return _global_peak_tracker("fsdp2_mem_tracker", "FSDPMemTracker")(model, optim)
    tracker = _global_peak_tracker("mem_tracker", "MemTracker")()
    tracker.track_external(model, *([optim] if optim is not None else []))
    return tracker


@functools.cache
def _global_peak_tracker(module: str, name: str) -> type:
    """torch.distributed._tools' `module`.`name` (MemTracker or FSDPMemTracker) keeping the
    global peak only: its own keeps every module's local peak too, a pass over every module for
    every op (most of a big model's fake step, for figures composerun does not read; the
    FSDPMemTracker's snapshots after each post-backward are taken by its hooks, not here).  Its
    private snapshot fields, checked on first use."""
    base = _require(f"torch.distributed._tools.{module}", name)
    total = _require("torch.distributed._tools.mem_tracker", "_TOTAL_KEY")

    class GlobalPeakMemTracker(base):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            if not all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
                return super()._update_peak_stats(peak_state)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[total]:
                    self._peak_mem[dev] = snap[total]
                    self._peak_mem_snap[dev] = dict(snap)

    return GlobalPeakMemTracker


def post_backward_snapshots(tracker: Any) -> list[dict[str, int]]:
    """Every snapshot an FSDPMemTracker took right after an FSDP unit's post-backward (its
    reduce-scatter issued): {category: bytes, "Total": bytes} each; [] for a MemTracker.
    The tracker keeps them per module in `memory_tracking` (no public getter)."""
    stats = getattr(tracker, "memory_tracking", None)
    state = getattr(importlib.import_module("torch.distributed._tools.fsdp2_mem_tracker"), "_FSDPModState", None)
    if stats is None or state is None:
        return []
    out = []
    for mod_stats in list(stats.values()):
        for snap in getattr(mod_stats, "snapshots", {}).get(state.AFT_POST_BW, []):
            for per_device in snap.values():
                out.append({str(getattr(k, "value", k)): int(v) for k, v in per_device.items()})
    return out


def next_iteration(tracker: Any) -> None:
    """Before a module's forward runs again inside one tracker (the next micro-batch):
    FSDPMemTracker refuses a second forward of a unit unless its per-module statistics are
    cleared (reset_mod_stats), which keeps the global peak."""
    reset = getattr(tracker, "reset_mod_stats", None)
    if reset is not None:
        reset()


def flop_formulas() -> dict[Any, Any]:
    """{op overload packet: its FLOP formula}, torch's own (torch.utils.flop_counter), with
    the CPU flash-attention kernels (what SDPA dispatches to on a CPU, the fake step's device)
    counted as the CUDA flash kernels they mirror (torch's table has no entry for them)."""
    table = dict(_require("torch.utils.flop_counter", "flop_registry"))
    aten = torch.ops.aten
    for cpu, cuda in (
        ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"),
    ):
        if hasattr(aten, cpu) and getattr(aten, cuda) in table:
            table.setdefault(getattr(aten, cpu), table[getattr(aten, cuda)])
    return table


def compile_backward_eagerly() -> None:
    """Have AOTAutograd compile a compiled module's backward at its first forward, not at its
    first backward (torch._functorch's `force_non_lazy_backward_lowering`, process-wide), so
    that a backward the compiler cannot compile fails where compile.fallback catches it."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        functorch_config.force_non_lazy_backward_lowering = True


def fake_tensor_failure(e: BaseException) -> str | None:
    """The op a forward on fake tensors could not run, when `e` says so: one that needs the
    values (a read to the host), or has no fake implementation; None for any other error."""
    fake = importlib.import_module("torch._subclasses.fake_tensor")
    kinds = tuple(
        getattr(fake, n)
        for n in ("DataDependentOutputException", "UnsupportedOperatorException", "DynamicOutputShapeException")
        if hasattr(fake, n)
    )
    if isinstance(e, kinds):
        return str(getattr(e, "func", "") or e)
    return None


# Allocations the CUDA allocator's history keeps, the oldest dropped first: a bound, so that the
# history itself stays small on a long run (torch keeps every one unless told).
MEMORY_HISTORY_ENTRIES = 100_000


def record_memory_history(on: bool) -> None:
    """Start (or stop) keeping the CUDA caching allocator's history of allocations and frees,
    with their Python stacks (not C++'s, the costly part of torch's default), for a memory
    snapshot (torch.cuda.memory._record_memory_history: private in torch 2.11 to 2.14,
    documented in "Understanding CUDA Memory Usage")."""
    record = _require("torch.cuda.memory", "_record_memory_history")
    record("all" if on else None, stacks="python", max_entries=MEMORY_HISTORY_ENTRIES)


def dump_memory_snapshot(path: str) -> None:
    """The allocator's state and history as a pickle that https://pytorch.org/memory_viz opens
    (torch.cuda.memory._dump_snapshot)."""
    _require("torch.cuda.memory", "_dump_snapshot")(path)


def flight_recorder_dump(nccl: bool) -> bytes:
    """This process's flight-recorder entries (its last collectives, with their Python stacks), as
    the pickle torch.distributed.flight_recorder's loader reads (`rank_{R}` files).  NCCL's
    watchdog writes the same itself on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT); this is for gloo,
    and for NCCL where the main thread saw the timeout first.  (torch._C._distributed_c10d's
    `_dump_nccl_trace` / `_dump_fr_trace`: private in torch 2.11 to 2.14.)

    Gloo's recorder leaves its groups' table empty (one entry named ''), and torch's analyzer
    looks each entry's group up there: the table is filled from this process's groups."""
    c10d = "torch._C._distributed_c10d"
    dump = _require(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace")
    data = pickle.loads(dump(True, True, False))
    groups = data.get("pg_config") or {}
    if not nccl and set(groups) <= {""}:
        import torch.distributed as dist

        world = _require("torch.distributed.distributed_c10d", "_world")
        data["pg_config"] = {
            name: {
                "name": name,
                "desc": getattr(pg, "group_desc", name),
                "ranks": str(dist.get_process_group_ranks(pg)),
            }
            for pg, name in world.pg_names.items()
        }
    return pickle.dumps(data)


def analyzer_reads_gloo() -> bool:
    """Whether torch's flight-recorder analyzer (torch.distributed.flight_recorder.fr_trace)
    matches gloo's entries: 2.13 and 2.14 do; 2.11's takes NCCL's (and XCCL's) only, and stops
    at a gloo entry with an assertion."""
    return _version() >= (2, 13)
