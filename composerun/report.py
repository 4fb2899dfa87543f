"""Reports over run directories: summary.csv, summary.md and PNG plots.

At the end of a sweep (`composerun -m ...`) a Hydra callback writes them into the sweep
directory; `composerun-report DIR` rebuilds them for any sweep or run directory.  One row
per run: model, mesh, policy, status (ok, failed, skipped) and its reason, final loss, last
validation loss (runs with eval.every), median step time, samples/s, tokens/s and MFU (token
models; MFU where a peak is known), peak memory (the process's, and one step's tracked peak),
bytes per rank, checkpoint size and stall, the resumes on another mesh (an elastic run's
node lost or back); for plan=true jobs the estimate: peak per rank, fits, the largest
micro-batch that fits, step time, tokens/s, MFU.  Plots: the loss curves,
the validation-loss curves (when a run evaluated), throughput and memory, and the planned
layouts that fit ranked by estimated step time (plan_ranking.png).  Runs with profile.steps'
traces get profile_summary.md too (composerun/profile_report.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback

from composerun.console import quiet_on_closed_pipe
from composerun.profile_report import write_profile_summary
from composerun.rundir import RunDir, write_json

COLUMNS = [
    "run", "model", "mesh", "policy", "status", "reason", "final_loss", "val_loss", "median_step_s", "samples_per_s",
    "tokens_per_s", "mfu", "peak_mem_mib", "measured_peak_mib", "bytes_per_rank", "checkpoint_mib",
    "checkpoint_stall_s", "job_wall_s", "mesh_changes", "est_peak_gib", "est_fits", "est_largest_micro_batch", "est_step_s",
    "est_tokens_per_s", "est_mfu",
]  # fmt: skip


def _metrics(run: Path) -> list[dict[str, Any]]:
    path = RunDir(run).metrics
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def save_stalls(rows: list[dict[str, Any]]) -> list[float]:
    """Seconds training was blocked by each save: its `checkpoint_stall_s`, plus, for an async
    save, the `checkpoint_wait_s` of the step that then waited for its staged copy."""
    stalls: list[float] = []
    for r in rows:
        if "checkpoint_wait_s" in r and stalls:
            stalls[-1] += r["checkpoint_wait_s"]
        if "checkpoint_stall_s" in r:
            stalls.append(r["checkpoint_stall_s"])
    return stalls


def _what_ran(run: Path) -> dict[str, Any]:
    """The model, mesh and policy of the run's `.hydra/config.yaml` (for a run whose ranks failed
    before rank 0 wrote them into summary.json); {} without a readable one."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(RunDir(run).hydra_files[0])
        model = OmegaConf.select(cfg, "model.name") or OmegaConf.select(cfg, "model._target_")
        shape = OmegaConf.select(cfg, "mesh.shape")
        return {"model": model, "mesh": "x".join(map(str, shape)) if shape else None,
                "policy": OmegaConf.select(cfg, "sharding.name")}  # fmt: skip
    except Exception:  # noqa: BLE001 - no config, or one that is not the schema's: the summary's say only
        return {}


def _row(root: Path, run: Path) -> dict[str, Any]:
    s = RunDir(run).read_summary() or {}  # (an unreadable one: a row with its name only)
    if s and not s.get("model"):
        s = {**_what_ran(run), **{k: v for k, v in s.items() if v is not None}}
    rows = _metrics(run)
    plan_path = RunDir(run).plan
    per_rank = None
    if plan_path.is_file():
        b = json.loads(plan_path.read_text())["bytes_per_rank"]
        per_rank = max(p + g + o for p, g, o in zip(b["params"], b["grads"], b["optim"], strict=True))
    ckpt = Path(s["checkpoint"]) if s.get("checkpoint") else None
    stalls = save_stalls(rows)
    steps = [r["step_s"] for r in rows]
    batch = rows[0]["samples_per_s"] * rows[0]["step_s"] if rows else None
    tokens = rows[0]["tokens_per_s"] / rows[0]["samples_per_s"] if rows and "tokens_per_s" in rows[0] else None
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    return {
        "run": str(run.relative_to(root)) if run != root else ".",
        "model": s.get("model"),
        "mesh": s.get("mesh"),
        "policy": s.get("policy"),
        "status": s.get("status"),
        "reason": s.get("reason") or s.get("error") or "",
        "final_loss": s.get("final_loss"),
        "val_loss": s.get("last_val_loss", vals[-1] if vals else None),
        "median_step_s": statistics.median(steps) if steps else None,
        "samples_per_s": batch / statistics.median(steps) if steps else None,
        "tokens_per_s": batch * tokens / statistics.median(steps) if steps and tokens else None,
        "mfu": s.get("mfu"),
        "peak_mem_mib": s["peak_mem_bytes"] / 2**20 if s.get("peak_mem_bytes") else None,
        "bytes_per_rank": per_rank,
        "checkpoint_mib": sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20 if ckpt and ckpt.is_dir() else None,
        "checkpoint_stall_s": statistics.median(stalls) if stalls else None,
        "job_wall_s": s.get("job_wall_s"),
        # each resume on another mesh (train/mesh_change.py): `2x2->1x2 at step 4 (13.1 s lost)`
        "mesh_changes": "; ".join(map(_mesh_change, s.get("mesh_changes") or [])),
        # the largest rank's peak of the step measured with torch's memory tracker (train/memory.py)
        "measured_peak_mib": max(s["measured_peak_bytes_per_rank"]) / 2**20 if s.get("measured_peak_bytes_per_rank") else None,
        # plan=true's estimate (parallel/estimate.py)
        "est_peak_gib": s["est_peak_bytes"] / 2**30 if s.get("est_peak_bytes") else None,
        **{k: s.get(k) for k in ("est_fits", "est_largest_micro_batch", "est_step_s", "est_tokens_per_s", "est_mfu")},
    }


def _mesh_change(c: dict[str, Any]) -> str:
    return f"{c.get('old_mesh')}->{c.get('new_mesh')} at step {c.get('step')} ({c.get('seconds_lost', 0):.1f} s lost)"


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(root: Path, failures: dict[str, str] | None = None) -> list[Path]:
    """Write summary.csv, summary.md and the plots that have something to show into `root`:
    loss_curves.png (runs that logged steps), val_curves.png (runs that evaluated),
    throughput_memory.png (runs that trained) and plan_ranking.png (plans with a device).
    `failures` (run dir -> reason): jobs that failed before they started, whatever their
    directory holds."""
    runs = [run.path for run in RunDir.under(root)]
    if not runs:
        raise FileNotFoundError(f"{root} holds no run (no summary.json below it)")
    rows = [_row(root, run) for run in runs]
    for run, row in zip(runs, rows, strict=True):
        reason = (failures or {}).get(str(run.resolve()))
        if reason is not None:
            row.update({k: None for k in row if k not in ("run", "model", "mesh", "policy")})
            row.update(status="failed", reason=reason)
    with open(root / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: _fmt(v) for k, v in r.items()} for r in rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]).replace("|", "/") for c in COLUMNS) + " |" for r in rows]
    (root / "summary.md").write_text("\n".join(lines) + "\n")
    profiled = write_profile_summary(root, runs)  # top ops, compute vs communication: profile_report.py
    return [root / "summary.csv", root / "summary.md", *_plots(root, runs, rows), *([profiled] if profiled else [])]


def _plots(root: Path, runs: list[Path], rows: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = lambda r: f"{r['model']} {r['mesh']} {r['policy']}"  # noqa: E731
    written = _val_plot(plt, root, runs, [label(r) for r in rows])
    # a plot with nothing to show is not written (a sweep of plan=true trains nothing)
    curves = [(label(r), m) for run, r in zip(runs, rows, strict=True) if (m := _metrics(run))]
    if curves:
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, m in curves:
            ax.plot([x["step"] for x in m], [x["loss"] for x in m], label=name)
        ax.set(xlabel="step", ylabel="loss", title="loss per step")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(root / "loss_curves.png", dpi=100)
        plt.close(fig)
        written.insert(0, root / "loss_curves.png")

    done = [r for r in rows if r["status"] == "ok" and r["samples_per_s"]]
    if not done:
        return [*written, *_ranking_plot(plt, root, rows)]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [label(r) for r in done]
    a1.barh(names, [r["samples_per_s"] for r in done])
    a1.set(xlabel="samples/s", title="throughput")
    a2.barh(names, [(r["bytes_per_rank"] or 0) / 2**20 for r in done])
    a2.set(xlabel="MiB per rank (params + grads + optimizer)", title="memory per rank")
    fig.tight_layout()
    fig.savefig(root / "throughput_memory.png", dpi=100)
    plt.close(fig)
    return [*written, root / "throughput_memory.png", *_ranking_plot(plt, root, rows)]


def _ranking_plot(plt: Any, root: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """plan_ranking.png: the planned layouts that fit, fastest estimated step first (a sweep
    of plan=true with plan.device), beside each one's estimated peak."""
    fit = sorted((r for r in rows if r["est_step_s"] and r["est_fits"] is not False), key=lambda r: r["est_step_s"])
    if not fit:
        return []
    names = [f"{r['model']} {r['mesh']} {r['policy']}" for r in fit][::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(fit) + 2))
    a1.barh(names, [r["est_step_s"] for r in fit][::-1])
    a1.set(xlabel="estimated step time (s)", title="layouts that fit, fastest at the top")
    a2.barh(names, [r["est_peak_gib"] or 0 for r in fit][::-1])
    a2.set(xlabel="estimated peak GiB per rank", title="memory")
    fig.tight_layout()
    fig.savefig(root / "plan_ranking.png", dpi=100)
    plt.close(fig)
    return [root / "plan_ranking.png"]


def _val_plot(plt: Any, root: Path, runs: list[Path], labels: list[str]) -> list[Path]:
    """val_curves.png: each run's validation loss per step, when any run evaluated."""
    curves = []
    for run, name in zip(runs, labels, strict=True):
        points = [(x["step"], x["val_loss"]) for x in _metrics(run) if "val_loss" in x]
        if points:
            curves.append((name, points))
    if not curves:
        return []
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in curves:
        ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.set(xlabel="step", ylabel="validation loss", title="validation loss per evaluation")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(root / "val_curves.png", dpi=100)
    plt.close(fig)
    return [root / "val_curves.png"]


@dataclass
class JobNotes:
    """What one job of a sweep tells the sweep's report: the value its task returns to Hydra."""

    run_dir: Path
    # it wrote into its directory (ran, planned, was skipped, or recorded its failure in a new
    # directory): a sweep whose every job had nothing to do or was refused in the directory of
    # an earlier sweep changed nothing, and leaves that sweep's report as it was
    wrote: bool = False
    failure: str | None = None  # why it failed its checks before it started


# Hydra makes the sweep's report from the config (hydra.callbacks) and hands it to nothing the
# command holds: the command opens `sweep_reports()` around Hydra to learn of the one it made.
_MADE: ContextVar[list[SweepReport] | None] = ContextVar("composerun_sweep_reports", default=None)


@contextmanager
def sweep_reports(made: list[SweepReport]) -> Iterator[None]:
    """While this block runs, each sweep report Hydra makes (one per sweep it starts) is added to `made`."""
    token = _MADE.set(made)
    try:
        yield
    finally:
        _MADE.reset(token)


class SweepReport(Callback):
    """Hydra callback: the report of a sweep, written into its directory at the end.  One per
    sweep; the jobs' notes reach it as the values their tasks return (`JobNotes`)."""

    def __init__(self) -> None:
        self.started: Path | None = None  # the sweep directory, once Hydra has named it
        self.failures: dict[str, str] = {}  # run dir -> why: jobs of this sweep that failed their checks
        self.report: Path | None = None  # summary.md, once written
        self.wrote = False  # whether any job wrote into its directory (JobNotes.wrote)
        self._t0 = 0.0
        self._reported = False
        self._multirun_yaml: bytes | None = None  # the sweep directory's multirun.yaml before Hydra rewrote it

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.started = Path(config.hydra.sweep.dir)
        earlier = self.started / "multirun.yaml"
        self._multirun_yaml = earlier.read_bytes() if earlier.is_file() else None
        self._t0 = time.perf_counter()
        made = _MADE.get()
        if made is not None:
            made.append(self)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """A job's notes: whether it wrote, and the failure of one that failed its checks before
        it started (its row says so, whatever its directory holds from an earlier sweep)."""
        notes = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if isinstance(notes, JobNotes):
            self.wrote = self.wrote or notes.wrote
            if notes.failure is not None:
                self.failures[str(notes.run_dir.resolve())] = notes.failure

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self.finish()

    def finish(self) -> Path | None:
        """Write the report of this sweep, once.  Hydra calls on_multirun_end only when every
        job succeeded; the CLI calls this when one failed (Hydra ran the others first), so a
        failed job leaves a report all the same."""
        root = self.started
        if root is None or self._reported:
            return None
        self._reported = True
        if not self.wrote:
            if self._multirun_yaml is not None:  # Hydra's sweeper rewrites it before any job: put it back
                tmp = root / "multirun.yaml.tmp"
                tmp.write_bytes(self._multirun_yaml)
                tmp.replace(root / "multirun.yaml")
            return None
        wall = time.perf_counter() - self._t0
        try:
            paths = write_report(root, self.failures)
        except FileNotFoundError:
            return None  # every job failed before it wrote anything
        timing = sweep_timing(root, wall)
        timing["report_s"] = time.perf_counter() - self._t0 - wall  # the table and plots, after the jobs
        write_json(root / "sweep.json", timing)
        # the overhead needs the jobs' own times (a sweep of plan=true jobs times none: it only plans)
        own = (
            f"the jobs' own wall times sum to {timing['jobs_wall_s']:.1f} s "
            f"(sweep overhead {100 * timing['overhead']:.1f}%); "
            if timing["overhead"] is not None
            else ""
        )
        print(f"composerun: sweep of {timing['jobs']} jobs ({timing['status']}): {wall:.1f} s; {own}report: {paths[1]}")
        self.report = paths[1]
        return paths[1]


def sweep_timing(root: Path, wall: float) -> dict[str, Any]:
    """The sweep's wall time (from Hydra's start of the sweep to its last job's end) against
    the sum of its jobs' wall times as each job measured itself."""
    summaries = [run.read_summary() or {} for run in RunDir.under(root)]
    jobs = sum(s.get("job_wall_s") or 0.0 for s in summaries)
    counts: dict[str, int] = {}
    for s in summaries:
        counts[s.get("status", "?")] = counts.get(s.get("status", "?"), 0) + 1
    return {
        "jobs": len(summaries),
        "status": ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        "wall_s": wall,
        "jobs_wall_s": jobs,
        "overhead": wall / jobs - 1 if jobs else None,
    }


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="composerun-report", description="Rebuild summary.csv/md and plots for a sweep or run directory."
    )
    p.add_argument("dir", type=Path, help="a sweep directory (multirun/...) or a run directory")
    args = p.parse_args(argv)
    if not args.dir.is_dir():
        print(f"composerun-report: error: {args.dir}: no such directory", file=sys.stderr)
        sys.exit(2)
    try:
        paths = write_report(args.dir)
    except FileNotFoundError as e:
        print(f"composerun-report: error: {e}: point it at a sweep or run directory", file=sys.stderr)
        sys.exit(2)
    print("\n".join(str(p) for p in paths))
