"""The processes and training runs of scripts/gpu_check.py: each item's process (its own group,
its own time limit, one line saying why it failed), and composerun's Llama on one GPU in bf16 under four
policies (eager, compile, compile + float8, compile + selective AC), each with its pre-flight
estimate (`plan=true`), as a user types them, and what their files say.

Every run goes through composerun's own command line (`python -m composerun ...`) with the
check's overrides; its figures come from the run directory: summary.json (the allocator's
`max_memory_allocated_bytes` / `max_memory_reserved_bytes`, the tracker's measured peak, FLOPs
per token) and metrics.jsonl (tokens/s and MFU of each logged interval).  A logged row's step
time is the mean over the steps since the previous read of the device, so the steady state is
the rows whose interval starts after the first `log_every` steps (compilation, the allocator
warming up) and holds no step of the memory tracker (which slows the step it measures).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The blocks of composerun's Llama are layers.N; the rules below are fsdp_blocks_sac's with a
# compile rule between checkpointing and sharding (the order the composable APIs need: the
# checkpointed forward is what gets compiled, and fully_shard's hooks stay outside both).
SAC = "{match: 'layers.*', api: checkpoint, mode: selective}"
SHARD = "{match: 'layers.*', api: fully_shard}, {match: '<root>', api: fully_shard}"


@dataclass(frozen=True)
class Shape:
    """What every run trains: the model preset, the global batch (one rank: one micro-batch),
    the steps, how often the host reads the device (the steady-state intervals), the device."""

    model: str
    batch: int
    steps: int
    log_every: int
    device: str  # cuda | cpu
    param_dtype: str = "bfloat16"
    compile_backend: str = "inductor"  # the dry run traces with dynamo's eager backend: no code generation

    def overrides(self) -> list[str]:
        return [
            f"+model={self.model}", "mesh=1", f"mesh.device={self.device}", f"data.batch_size={self.batch}",
            f"train.steps={self.steps}", f"train.log_every={self.log_every}",
            f"sharding.param_dtype={self.param_dtype}", "sharding.reduce_dtype=float32",
            "checkpoint=none", "metrics.progress=false",
        ]  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    policy: list[str]  # the sharding overrides
    compile_rule: int | None = None  # the index of the policy's compile rule (its backend set in a dry run)
    needs_float8: bool = False
    # the memory tracker's step (summary.json's measured_peak_bytes_per_rank) on the eager run only:
    # under compile the tracker's dispatch mode would cost the compiled runs a recompilation
    track_memory: bool = False
    extra: list[str] = field(default_factory=list)

    def overrides(self, shape: Shape) -> list[str]:
        out = [*shape.overrides(), *self.policy, f"metrics.track_memory={str(self.track_memory).lower()}"]
        if self.compile_rule is not None and shape.compile_backend != "inductor":
            out.append(f"sharding.rules.{self.compile_rule}.backend={shape.compile_backend}")
        return out + self.extra


CASES = [
    Case("eager", ["sharding=fsdp_blocks"], track_memory=True),
    Case("compile", ["sharding=fsdp_blocks_compile"], compile_rule=0),
    Case("compile+float8", ["sharding=fsdp_blocks_float8"], compile_rule=1, needs_float8=True),
    Case(
        "compile+selective AC",
        [
            "sharding=fsdp_blocks",
            "sharding.name=fsdp_blocks_sac_compile",
            f"sharding.rules=[{SAC}, {{match: 'layers.*', api: compile}}, {SHARD}]",
        ],
        compile_rule=1,
    ),
]


def plan_overrides(case: Case, shape: Shape, plan_device: str | None, memory_gib: float | None) -> list[str]:
    """The same command as the case's run, planned: plan.json's estimate (peak per rank, the
    step time on the device).  No micro-batch search: the batch is the run's."""
    out = [*case.overrides(shape), "plan=true", "plan.search_batch=false"]
    if plan_device:
        out.append(f"plan.device={plan_device}")
    elif memory_gib:
        out.append(f"plan.memory_gib={memory_gib:.1f}")
    return out


def read_estimate(plan_dir: Path) -> dict[str, Any]:
    """plan.json's estimate, as the table shows it (KeyError/OSError when the plan wrote none)."""
    est = json.loads((plan_dir / "plan.json").read_text())["estimate"]
    step = est.get("step_time") or {}
    return {
        "peak_bytes": est["peak_bytes_per_rank"][0],
        "reserved_bytes": (est.get("peak_reserved_bytes_per_rank") or [None])[0],
        "fits": (est.get("memory") or {}).get("fits"),
        "breakdown": est.get("breakdown"),
        "device": step.get("device"),
        "step_s": step.get("step_s"),
        "tokens_per_s": step.get("tokens_per_s"),
        "mfu": step.get("mfu"),
    }


def steady_rows(rows: list[dict[str, Any]], warmup: int, tracked: int | None) -> list[tuple[int, dict[str, Any]]]:
    """(first step of its interval, row) of the logged rows whose interval (the steps since the
    previous row) starts after step `warmup` and does not hold the tracked step."""
    out, prev = [], 0
    for row in sorted(rows, key=lambda r: r["step"]):
        first, last = prev + 1, row["step"]
        prev = last
        if first > warmup and not (tracked is not None and first <= tracked <= last):
            out.append((first, row))
    return out


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def read_run(run_dir: Path, shape: Shape) -> dict[str, Any]:
    """A finished run's figures: the steady state's median step time, tokens/s and MFU (composerun's
    own rates of those rows), the allocator's peaks, the tracker's, the first step's time."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("step_s"), (int, float))]
    intervals = steady_rows(rows, shape.log_every, summary.get("measured_peak_step"))
    steady = [row for _, row in intervals]
    tracked = summary.get("measured_peak_bytes_per_rank") or [None]
    return {
        # None where the run was too short for a steady state (a failed check, not a number)
        "step_s": _median([r["step_s"] for r in steady]),
        "tokens_per_s": _median([r.get("tokens_per_s") for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "steady_steps": [intervals[0][0], steady[-1]["step"]] if steady else None,
        "max_memory_allocated_bytes": summary.get("max_memory_allocated_bytes"),
        "max_memory_reserved_bytes": summary.get("max_memory_reserved_bytes"),
        "peak_mem_bytes": summary.get("peak_mem_bytes"),  # the allocator's on a GPU; the process's RSS on a CPU
        "tracker_peak_bytes": tracked[0],
        "flops_per_token": summary.get("flops_per_token"),
        "peak_flops": summary.get("peak_flops"),
        "tokens_per_sample": summary.get("tokens_per_sample"),
        "first_loss": summary.get("first_loss"),
        "final_loss": summary.get("final_loss"),
        "time_to_first_step_s": summary.get("time_to_first_step_s"),
        "run_wall_s": summary.get("wall_s"),
        "policy": summary.get("policy"),
    }


def run(cmd: list[str], log: Path, timeout: float, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run `cmd` in a process group of its own (ranks and compile workers included), its output
    into `log`; killed, group and all, at `timeout`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, timed_out = proc.wait(), True
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1), "log": str(log)}


def why(log: Path) -> str:
    """One line for a failed item: the last line of its output that names an error, else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|Exception|error:|refused|Unrunnable|FAILED)", ln)]
    return (errors or lines or ["no output"])[-1][:300]


def outcome(name: str, kind: str, res: dict[str, Any], timeout: float | None, **extra: Any) -> dict[str, Any]:
    if res["timed_out"]:
        status, reason = "failed", f"timed out after {timeout:.0f} s"
    elif res["rc"] != 0:
        status, reason = "failed", why(Path(res["log"]))
    else:
        status, reason = "ok", None
    return {"name": name, "kind": kind, "status": status, "reason": reason, **res, **extra}


def skipped(name: str, kind: str, reason: str) -> dict[str, Any]:
    return {"name": name, "kind": kind, "status": "skipped", "reason": reason}
