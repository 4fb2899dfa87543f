"""What a run does after its last step: the async save in flight published, the export and
the verification it was asked for, and its summary.json (rank 0) with the line that says it
is done; a preempted run stops here with the line the launcher shows."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from composerun import _torch_compat as compat
from composerun import stopping
from composerun.checkpoint.export import export_safetensors
from composerun.checkpoint.folders import find_latest
from composerun.checkpoint.hf_export import export_hf
from composerun.checkpoint.peft_export import export_peft
from composerun.config.schema import byte_size
from composerun.errors import LOG_FILE_ONLY, Preempted
from composerun.rundir import RunDir
from composerun.train.evaluate import val_summary
from composerun.train.mesh_change import mesh_changes
from composerun.train.metrics import allocator_peaks, peak_memory_bytes
from composerun.train.setup import Setup
from composerun.train.trainer import Trainer
from composerun.train.verify import VerifyError, failure_line, verify

log = logging.getLogger("composerun")


def finish(setup: Setup, trainer: Trainer, t_start: float) -> dict[str, Any]:
    """Publish, export, verify, summarise; the summary (a preempted run raises Preempted)."""
    t_finish = time.perf_counter()
    setup.ckpt.close()  # the async save still in flight (a preempted run's too), published
    finish_s = time.perf_counter() - t_finish
    exported = checked = None
    if setup.cfg.checkpoint.export.value == "safetensors" and not trainer.stopped_at:
        exported = export_safetensors(setup.model, RunDir(setup.run_dir).export("safetensors"), {"step": str(trainer.end)})
    if setup.cfg.checkpoint.export.value == "hf" and not trainer.stopped_at:
        shard = byte_size(setup.cfg.checkpoint.export_max_shard_size)
        exported = export_hf(setup.model, setup.cfg, RunDir(setup.run_dir).export("hf"), shard)
    if setup.cfg.checkpoint.export.value == "peft" and not trainer.stopped_at:
        exported = export_peft(setup.model, setup.cfg, RunDir(setup.run_dir).export("peft"))
    if setup.cfg.checkpoint.verify and not trainer.stopped_at:
        checked = verify(setup.cfg, setup.model, setup.optim, setup.data, steps=trainer.end)
    if not trainer.step_times and setup.ckpt.last_saved is None and setup.resumed is not None:
        setup.ckpt.last_saved = setup.resumed  # nothing left to train: the resumed checkpoint is the final one
    wall = time.perf_counter() - t_start  # the run's wall time: in summary.json and the line below
    summary = summarize(setup, trainer, wall, finish_s, exported, checked)
    if trainer.stopped_at:
        _preempted(summary, setup.run_dir, setup.start.resume)
    if dist.get_rank() == 0:
        RunDir(setup.run_dir).write_summary(summary)
        loss = f"{summary['final_loss']:.4g}" if summary["final_loss"] is not None else "n/a"
        med = f"{summary['median_step_s'] * 1e3:.1f} ms/step" if summary["median_step_s"] else "no steps run"
        if summary.get("last_val_loss") is not None:
            loss += f" (validation {summary['last_val_loss']:.4g})"
        log.info(
            "composerun: done: %s on mesh %s (%s), %d steps, final loss %s, %s, %.1f s; run dir %s",
            *(summary["model"], summary["mesh"], summary["policy"], trainer.end, loss, med),
            *(wall, setup.run_dir),
            extra=LOG_FILE_ONLY,  # the command prints its own, with the time the user waited
        )
    if checked is not None and not checked["ok"]:
        raise VerifyError(failure_line(checked))
    return summary


def summarize(
    setup: Setup, trainer: Trainer, wall: float, finish_s: float, exported: Path | None, checked: dict | None
) -> dict[str, Any]:
    """summary.json's content.  A run that trained nothing (a finished run run again to export
    or verify, train.steps=0) keeps the summary of the run that trained up to here."""
    trained = bool(trainer.step_times)
    earlier = {} if trained else _earlier_results(setup.run_dir, setup.resumed, trainer.end)
    if not trained and earlier.get("summary"):
        summary = {**earlier["summary"], "export": str(exported) if exported else earlier["summary"].get("export")}
        summary.update(verify=checked if checked is not None else summary.get("verify"), steps_this_run=0)
        return summary
    # the wall clock when the first step ended, for start-up measured from outside the process
    first_end = None if trainer.t_first_step is None else time.time() - (wall - trainer.t_first_step)
    return {
        "status": "preempted" if trainer.stopped_at else "ok",
        "model": setup.report["model"],
        "mesh": setup.report["mesh"],
        "world_size": dist.get_world_size(),
        "policy": setup.report["policy"],
        "steps": trainer.end,
        "start_step": trainer.start,
        "preempted_at_step": trainer.stopped_at,
        "resumed_from": str(setup.resumed) if setup.resumed else None,
        # every resume on another mesh than its checkpoint's, from the rows (train/mesh_change.py)
        "mesh_changes": mesh_changes(_metrics_rows(setup.run_dir, trainer.end) or []),
        "first_loss": trainer.first_loss if trained else earlier.get("first_loss"),
        "final_loss": trainer.last_loss if trained else earlier.get("final_loss"),
        "median_step_s": statistics.median(trainer.step_times) if trained else earlier.get("median_step_s"),
        "time_to_first_step_s": trainer.t_first_step,
        "first_step_end_unix": first_end,
        "resume_s": setup.resume_s if setup.resumed is not None else None,
        "wall_s": wall,
        "peak_mem_bytes": peak_memory_bytes(setup.device),
        # a GPU's max_memory_allocated_bytes and max_memory_reserved_bytes (none on a CPU): train/metrics.py
        **allocator_peaks(setup.device),
        "checkpoint": str(setup.ckpt.last_saved) if setup.ckpt.last_saved else None,
        "checkpoint_finish_s": finish_s,
        "export": str(exported) if exported else None,
        "verify": checked,
        "run_dir": str(setup.run_dir),
        # measured after the first step of this run: params, grads, optimizer state per rank
        "measured_bytes_per_rank": trainer.measured,
        # the peak of one step on every rank, by the tracker plan=true's estimate uses (train/memory.py)
        **(trainer.memory.result or {}),
        "steps_this_run": len(trainer.step_times),
        # graphs torch.compile made in this run (rank 0): one per distinct compiled forward, each
        # recompilation one more (evaluation makes none: train/evaluate.py)
        "compiled_graphs": compat.compiled_graphs() - trainer.graphs_at_start,
        # tokens/s (global, per rank), flops_per_token, mfu at the median step time: train/throughput.py
        **trainer.throughput.summary(trainer.step_times),
        # best_val_loss (+ best_val_step), last_val_loss, last_val_ppl: train/evaluate.py
        **val_summary(trainer.evaluator.history, (_metrics_rows(setup.run_dir, trainer.start) or []) if setup.resumed else []),
    }


def _earlier_results(run_dir: Path, resumed: Path | None, step: int) -> dict[str, Any]:
    """The results of the run that trained up to `step`: its summary.json (under "summary"),
    when that is a finished run's naming the checkpoint resumed from (by its folder's name: a
    run directory may have moved), else its rows in metrics.jsonl (final loss, median step time)."""
    earlier = RunDir(run_dir).read_summary() or {}
    same = resumed is not None and Path(earlier.get("checkpoint") or "").name == resumed.name
    if same and earlier.get("status") == "ok":
        return {"summary": earlier, **{k: earlier.get(k) for k in ("first_loss", "final_loss", "median_step_s")}}
    rows = _metrics_rows(run_dir, step)
    if rows is None:
        return {}
    last = [r for r in rows if r["step"] == step]
    times = [r["step_s"] for r in rows if isinstance(r.get("step_s"), (int, float))]
    return {
        "final_loss": last[-1].get("loss") if last else None,
        "median_step_s": statistics.median(times) if times else None,
    }


def _metrics_rows(run_dir: Path, step: int) -> list[dict[str, Any]] | None:
    """The rows of metrics.jsonl up to step `step` (those of the runs this one continues), or
    None where the file cannot be read."""
    rows = []
    try:
        for line in RunDir(run_dir).metrics.read_text().splitlines():
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
    except (OSError, ValueError):
        return None
    return rows


def _preempted(summary: dict[str, Any], run_dir: Path, resume: str) -> None:
    """Stop a run that every rank agreed to preempt: its checkpoint is published; say so
    (summary.json, rank 0's log) and leave with the line the launcher shows."""
    summary["signal"] = stopping.requested()  # None where only another rank got it
    newest = find_latest(RunDir(run_dir).checkpoints)
    stop = Preempted(run_dir, summary["preempted_at_step"], summary["checkpoint"], resume, summary["signal"], newest)
    if dist.get_rank() == 0:
        RunDir(run_dir).write_summary(summary)
        log.info("composerun: %s", stop, extra=LOG_FILE_ONLY)  # the command prints the line (once)
    raise stop
