"""Seeing where a step's time and memory go: torch.profiler traces of `profile.steps` on every
rank, the CUDA allocator's history and its snapshots (`profile.memory_snapshot`), and the one
line a rank that runs out of memory ends with.

Off is free: with no profile.steps no profiler object exists, and the allocator's history is
kept only on a GPU (on_oom, the default: from the first step; steps: over the profiled ones).
Everything a rank writes goes to its own folder, RUN/profile/rank{R}/ (rundir.py):

- `steps-A-B.pt.trace.json`: a Chrome trace (Perfetto, chrome://tracing, TensorBoard's profiler
  plugin) of steps A to B with shapes and memory, each step under a `composerun step N` range,
  the collectives (gloo's or NCCL's) among the ops;
- `memory-steps-A-B.pickle` (steps) or `oom-step-N.pickle` (on_oom): a memory snapshot for
  https://pytorch.org/memory_viz."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from composerun import _torch_compat as compat
from composerun.config.schema import MemorySnapshot, ProfileConfig
from composerun.errors import OutOfMemory
from composerun.parallel.plan import fmt_bytes
from composerun.rundir import RunDir
from composerun.train.metrics import peak_memory_bytes


class StepProfiler:
    """torch.profiler over profile.steps [A, B] (those after the resumed step) on one rank."""

    def __init__(self, span: list[int], start: int, folder: Path, device: torch.device, snapshot: bool) -> None:
        self.first, self.last = max(span[0], start + 1), span[1]
        self.folder, self.device, self.snapshot = folder, device, snapshot and device.type == "cuda"
        self.prof: Any = None
        self.at = self.first  # the last step begun under the profiler
        self.range: AbstractContextManager | None = None

    def begin(self, step: int) -> None:
        """Before step `step` (1-based, as in metrics.jsonl)."""
        if not self.first <= step <= self.last:
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.snapshot:
                compat.record_memory_history(True)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.prof.start()
        self.at = step
        self.range = torch.profiler.record_function(f"composerun step {step}")
        self.range.__enter__()

    def end(self, step: int) -> None:
        """After step `step`: the trace written after the last one."""
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (a run that ended inside the span too)."""
        if self.prof is None:
            return
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        prof, self.prof = self.prof, None
        prof.stop()
        last = self.at
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.folder / f"steps-{self.first}-{last}.pt.trace.json"))
        if self.snapshot:
            compat.dump_memory_snapshot(str(self.folder / f"memory-steps-{self.first}-{last}.pickle"))
            compat.record_memory_history(False)


def step_profiler(
    cfg: ProfileConfig, run_dir: Path, rank: int, start: int, device: torch.device
) -> StepProfiler | None:
    """The profiler of profile.steps, or None (no steps, or all of them before the resumed step)."""
    if cfg.steps is None or cfg.steps[1] <= start:
        return None
    snapshot = cfg.memory_snapshot == MemorySnapshot.steps
    return StepProfiler(list(cfg.steps), start, RunDir(run_dir).profile(rank), device, snapshot)


def keep_memory_history(cfg: ProfileConfig, device: torch.device) -> bool:
    """on_oom on a GPU: keep the allocator's history from now on (whether it is kept)."""
    if cfg.memory_snapshot != MemorySnapshot.on_oom or device.type != "cuda":
        return False
    compat.record_memory_history(True)
    return True


def out_of_memory(
    e: BaseException, step: int, run_dir: Path, rank: int, device: torch.device, kept: bool
) -> OutOfMemory:
    """The error a rank that ran out of memory in step `step` ends with: one line with the peak,
    the pre-flight estimate where a plan=true of the same run directory left one, the snapshot
    (dumped here, when the allocator's history was kept), and what to try."""
    run = RunDir(run_dir)
    peak = peak_memory_bytes(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        where = f"peak allocated {fmt_bytes(peak)} of {fmt_bytes(total)}"
    else:
        where = f"peak resident {fmt_bytes(peak)} (the process's)"
    planned = run.read_summary() or {}
    if planned.get("status") == "planned" and planned.get("est_peak_bytes"):
        estimate = f"plan=true's estimated peak {fmt_bytes(planned['est_peak_bytes'])} per rank"
        if planned.get("est_largest_micro_batch"):
            estimate += f", largest micro-batch that fits {planned['est_largest_micro_batch']}"
    else:
        estimate = "no pre-flight estimate (plan=true with the same config gives one)"
    if kept:
        path = run.profile(rank) / f"oom-step-{step}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compat.dump_memory_snapshot(str(path))
            snapshot = f"memory snapshot {path} (open it at https://pytorch.org/memory_viz)"
        except Exception as dump_failed:  # noqa: BLE001 - the OOM is the error to report
            snapshot = f"no memory snapshot ({type(dump_failed).__name__}: {dump_failed})"
    elif device.type != "cuda":
        snapshot = f"no memory snapshot (a {device.type} device has no CUDA allocator history)"
    else:
        snapshot = "no memory snapshot (profile.memory_snapshot=on_oom keeps one)"
    first = (str(e).strip().splitlines() or [""])[0]
    return OutOfMemory(
        f"out of memory at step {step} on rank {rank} ({first[:200]}): {where}; {estimate}; {snapshot}; "
        "try a smaller micro-batch (data.batch_size, or train.grad_accum=N), activation checkpointing "
        "(sharding=fsdp_blocks_ac), or plan=true to see what fits"
    )
