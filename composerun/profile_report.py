"""The profiled steps' summary that `composerun-report` adds for runs with traces: from each
rank's Chrome trace in profile/rank{R}/ (train/profile.py), the ops that took the most time of
their own (self time: an op's time less that of the ops and ranges it called) summed over the
ranks, and per rank the profiled steps' time split into communication and the rest.

Communication is the time any collective ran: on a GPU the NCCL kernels (compute: the other
kernels; the rest of a step the GPU idled), on a CPU the host's collective ops (`c10d::`,
`gloo:`), every thread's, with compute the rest of the steps' time."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from composerun.rundir import RunDir

COMM = re.compile(r"^(c10d::|gloo:|nccl:)|nccl", re.IGNORECASE)
STEP = "composerun step "  # the range train/profile.py opens around each profiled step
TOP = 15  # ops in the table


def rank_traces(run: Path) -> dict[int, list[Path]]:
    """Each rank's traces under RUN/profile/rank{R}/, by rank."""
    root = RunDir(run).profile(0).parent
    ranks = sorted(int(p.name[4:]) for p in root.glob("rank*") if p.name[4:].isdigit()) if root.is_dir() else []
    traces = {r: sorted(RunDir(run).profile(r).glob("*.pt.trace.json")) for r in ranks}
    return {r: t for r, t in traces.items() if t}


def complete_events(path: Path) -> list[dict[str, Any]]:
    """The trace's complete events (ph X: a name, a start and a duration, in microseconds)."""
    return [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def self_times(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """{op: [self microseconds, calls]} of the host's ops (cpu_op) and the GPU's kernels: an op's
    self time is its duration less that of the ops and ranges directly inside it on its thread
    (torch's key_averages' self CPU time); a kernel's is its duration."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    nested = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    by_thread: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in nested:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [event, time of its direct children]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                _close(stack.pop(), out)
            if stack:  # (a child that outlasts its parent, as some dispatch ranges do, counts to its end)
                parent = stack[-1][0]
                stack[-1][1] += min(e["ts"] + e["dur"], parent["ts"] + parent["dur"]) - e["ts"]
            stack.append([e, 0.0])
        while stack:
            _close(stack.pop(), out)
    for e in events:
        if e.get("cat") == "kernel":
            out[e["name"]][0] += e["dur"]
            out[e["name"]][1] += 1
    return dict(out)


def _close(item: list[Any], out: dict[str, list[float]]) -> None:
    event, children = item
    if event.get("cat") == "cpu_op":
        out[event["name"]][0] += event["dur"] - children
        out[event["name"]][1] += 1


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def split(events: list[dict[str, Any]]) -> dict[str, float]:
    """The profiled steps' microseconds: {steps, steps_us, comm_us, compute_us}."""
    steps = [e for e in events if e["name"].startswith(STEP)]
    spans = [(s["ts"], s["ts"] + s["dur"]) for s in steps]

    def inside(e: dict[str, Any]) -> bool:
        return any(a <= e["ts"] < b for a, b in spans)

    kernels = [e for e in events if e.get("cat") == "kernel" and inside(e)]
    if kernels:  # a GPU: what its streams ran
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if COMM.search(e["name"])])
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not COMM.search(e["name"])])
    else:  # a CPU: the host's collectives, the rest compute
        ops = [e for e in events if e.get("cat") == "cpu_op" and COMM.search(e["name"]) and inside(e)]
        comm = _union([(e["ts"], min(e["ts"] + e["dur"], max(b for a, b in spans if a <= e["ts"]))) for e in ops])
        compute = sum(b - a for a, b in spans) - comm
    return {"steps": len(steps), "steps_us": sum(b - a for a, b in spans), "comm_us": comm, "compute_us": compute}


def summary_lines(run: Path, name: str) -> list[str]:
    """The markdown section of one run (none where it has no traces)."""
    traces = rank_traces(run)
    if not traces:
        return []
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    lines = [f"## {name}", "", "| rank | trace | steps | step ms | compute ms | communication ms | communication % |"]
    lines.append("|---|---|---|---|---|---|---|")
    for rank, paths in traces.items():
        for path in paths:
            events = complete_events(path)
            s = split(events)
            share = 100 * s["comm_us"] / s["steps_us"] if s["steps_us"] else 0.0
            lines.append(
                f"| {rank} | {path.name} | {s['steps']} | {s['steps_us'] / 1e3:.2f} | {s['compute_us'] / 1e3:.2f} "
                f"| {s['comm_us'] / 1e3:.2f} | {share:.1f} |"
            )
            for op, (us, calls) in self_times(events).items():
                ops[op][0] += us
                ops[op][1] += calls
    total = sum(us for us, _ in ops.values()) or 1.0
    lines += ["", f"Top {TOP} ops by self time, all ranks:", "", "| op | self ms | % | calls |", "|---|---|---|---|"]
    for op, (us, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:TOP]:
        lines.append(f"| {op.replace('|', '/')} | {us / 1e3:.3f} | {100 * us / total:.1f} | {calls} |")
    return [*lines, ""]


def write_profile_summary(root: Path, runs: list[Path]) -> Path | None:
    """profile_summary.md in `root`, of every run with traces; None where none has."""
    sections = []
    for run in runs:
        sections += summary_lines(run, str(run.relative_to(root)) if run != root else run.name)
    if not sections:
        return None
    path = root / "profile_summary.md"
    path.write_text("# Profiled steps\n\n" + "\n".join(sections))
    return path
