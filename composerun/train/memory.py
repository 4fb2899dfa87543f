"""The peak memory of one training step, measured on every rank by the tracker the pre-flight
estimate uses (parallel/estimate.py), so that a run's summary.json holds the figure beside
which plan=true's estimate can be set (`measured_peak_bytes_per_rank`).

The step measured is the second of the run (the first whose optimizer state exists from its
start, as in every later step), or the first when the run trains one step; `metrics.track_memory
=false` measures none.  The tracker is torch's FSDPMemTracker (the root an FSDP unit) or
MemTracker (any other root), a dispatch mode that sees every op of the step: that step is
slower (the metrics row says `memory_tracked`), the others are not touched.  On a GPU the
allocator's own peak is in every row beside it (`peak_mem_bytes`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from composerun import _torch_compat as compat
from composerun.parallel.estimate import categorized


class MemoryProbe:
    """Measures the step `at` (1-based) of a run, if it trains it."""

    def __init__(
        self, model: torch.nn.Module, optim: torch.optim.Optimizer, device: torch.device, start: int, end: int, on: bool
    ) -> None:
        self.model, self.optim, self.device = model, optim, device
        self.at = min(start + 2, end) if on and end > start else None
        self.result: dict[str, Any] | None = None
        self.active: _Measured | None = None  # the tracker of the step being measured

    def next_micro_batch(self) -> None:
        """Between two micro-batches of the measured step (the tracker takes one forward per
        FSDP unit at a time: its per-module statistics are cleared, its peak kept)."""
        if self.active is not None:
            compat.next_iteration(self.active.tracker)

    def around(self, step: int) -> Any:
        """The context for training step `step` (0-based): the tracker on the step measured."""
        if self.at is None or step + 1 != self.at:
            return nullcontext()
        return _Measured(self)


class _Measured:
    def __init__(self, probe: MemoryProbe) -> None:
        self.probe = probe
        self.tracker = compat.memory_tracker(probe.model, probe.optim)

    def __enter__(self) -> None:
        self.tracker.__enter__()
        self.probe.active = self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        self.probe.active = None
        self.tracker.__exit__(kind, *rest)
        if kind is not None:
            return
        snaps = self.tracker.get_tracker_snapshot("peak")  # {device: ...}: the training device's
        snap = snaps.get(self.probe.device) or next(iter(snaps.values()), {})
        mine = {"peak": int(snap.get("Total", 0)), "breakdown": categorized(snap)}
        every: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        self.probe.result = {
            "measured_peak_bytes_per_rank": [e["peak"] for e in every],
            "measured_peak_breakdown": every[0]["breakdown"],  # rank 0's, named as plan.json's estimate
            "measured_peak_step": self.probe.at,
        }
