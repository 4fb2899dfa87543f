"""Per-step metrics: JSON lines in metrics.jsonl (one per logged step: a resumed run first
drops the rows of the steps it trains again), TensorBoard event files when asked (every
numeric key of a row: loss, val_loss, tokens_per_s, mfu ...), W&B and MLflow when
metrics.sinks lists them (train/sinks.py), and a tqdm bar on rank 0
whose postfix shows the loss, the LR and the last validation loss; when stderr is no terminal
(nohup, SLURM, a pipe), the bar is silent and each logged step is a plain line instead, on the
console and in rank0.log.  Only rank 0 writes."""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from composerun.config.schema import Config, Sink
from composerun.rundir import RunDir
from composerun.train.sinks import chosen, open_external

log = logging.getLogger("composerun")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux: the process's peak resident set
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def allocator_peaks(device: torch.device) -> dict[str, int]:
    """summary.json's figures of the GPU caching allocator since set-up (reset_peak_memory):
    the most that tensors held (`max_memory_allocated`) and the most it took from the device
    for them, its cached free blocks and fragmentation included (`max_memory_reserved`: what
    the device could not give to anything else).  Nothing on a CPU, which has no such allocator."""
    if device.type != "cuda":
        return {}
    return {
        "max_memory_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over (a GPU's allocator; a process's peak resident set cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def drop_redone_rows(path: Path, start: int) -> None:
    """One row per step for every reader: a run that resumes after step `start` trains the
    steps after it again, so the rows a stopped run logged for them (after its last checkpoint)
    go, and a line it left half-written with them."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= start:
            kept.append(line)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def step_line(row: dict[str, Any], total: int) -> str:
    """`step 3/20: loss 0.4148, lr 1.00e-03, 174.7 ms/step` (and the step's validation loss)."""
    line = f"step {row['step']}/{total}: loss {row['loss']:.4g}, lr {row['lr']:.2e}"
    if isinstance(row.get("step_s"), float):
        line += f", {row['step_s'] * 1e3:.1f} ms/step"
    if row.get("val_loss") is not None:
        line += f", validation loss {row['val_loss']:.4g}"
    return line


class Metrics:
    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, start: int, report: dict[str, Any]):
        self.enabled = enabled
        self.val_loss: float | None = None  # the last evaluation's, shown until the next one
        self.file = self.tb = self.bar = None
        self.total, self.lines, self.external = cfg.train.steps, False, []
        if not enabled:
            return
        run = RunDir(run_dir)
        drop_redone_rows(run.metrics, start)
        self.file = open(run.metrics, "a", buffering=1)
        self.external = open_external(cfg, run_dir, report)  # W&B, MLflow: train/sinks.py
        if Sink.tensorboard in chosen(cfg):
            from torch.utils.tensorboard import SummaryWriter  # imported only when asked: slow import

            # TensorBoard's readers drop the stopped run's events from step start + 1 on, too
            self.tb = SummaryWriter(str(run.tensorboard), purge_step=start + 1 if start else None)
        if cfg.metrics.progress:
            # disable=None: on only when stderr is a terminal
            self.bar = tqdm(total=self.total, initial=start, desc="train", unit="step", disable=None, file=sys.stderr)
            self.lines = self.bar.disable  # no terminal: a line per logged step instead

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])
        for sink in self.external:
            sink.log(row)
        if self.lines:
            log.info("%s", step_line(row, self.total))
        if self.bar is not None:
            self.val_loss = row.get("val_loss", self.val_loss)
            shown = {"loss": f"{row['loss']:.4g}", "lr": f"{row['lr']:.2e}"}
            if self.val_loss is not None:
                shown["val_loss"] = f"{self.val_loss:.4g}"
            self.bar.set_postfix(shown, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        for h in (self.bar, self.tb, *self.external, self.file):
            if h is not None:
                h.close()
