"""What every rank runs: mesh, model, policy, optimizer, data, resume, train, checkpoint.

`run(cfg, run_dir)` takes the resolved config as a plain dict; it never touches Hydra, so
the same function serves self-launched ranks, torchrun ranks and one in-process rank.  It
owns the process group; `train(cfg, run_dir, mesh, device)` is one training run on a mesh
that already exists (the tests run many of them on one set of ranks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from composerun import stopping
from composerun.checkpoint.checkpointer import Checkpointer
from composerun.checkpoint.export import export_safetensors, init_from
from composerun.checkpoint.folders import find_latest
from composerun.data import build_data
from composerun.errors import Preempted
from composerun.files import read_summary, write_json
from composerun.models import build_model
from composerun.parallel.apply import apply_policy
from composerun.parallel.gradnorm import GradNorm
from composerun.parallel.mesh import init_mesh, teardown
from composerun.parallel.plan import build_report, format_table, gather_measured_bytes, write_plan
from composerun.train.metrics import Metrics, peak_memory_bytes
from composerun.train.optim import build_optimizer, set_lr
from composerun.train.verify import VerifyError, verify
from composerun.train.verify import failure_line as verify_failure_line

log = logging.getLogger("composerun")


class NonFiniteLossError(RuntimeError):
    pass


def _grad_sync_switches(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def run(cfg: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    # From here on SIGTERM/SIGUSR1 are recorded, not fatal: one that arrives during
    # start-up stops the run after its first step, with a checkpoint.
    with stopping.recording():
        torch.use_deterministic_algorithms(cfg["train"]["deterministic"], warn_only=True)
        mesh, device = init_mesh(cfg["mesh"])
        try:
            summary = train(cfg, Path(run_dir), mesh, device)
        except Preempted:
            teardown()  # every rank agreed to stop after the same step: none is inside a collective
            raise
        teardown()
    return summary


def train(cfg: dict[str, Any], run_dir: Path, mesh: DeviceMesh, device: torch.device) -> dict[str, Any]:
    t_start = time.perf_counter()
    tr, ocfg = cfg["train"], cfg["optim"]
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir.mkdir(parents=True, exist_ok=True)

    # One seeded initialization, the same on every mesh: build whole, then shard in place.
    torch.manual_seed(tr["seed"])
    model = build_model(cfg["model"]).to(device)
    plan = apply_policy(model, cfg["sharding"], mesh)
    optim = build_optimizer(model, ocfg)
    report = build_report(model, plan, cfg)
    data = build_data(cfg)
    ccfg = cfg["checkpoint"]
    if ccfg.get("init_from"):
        init_from(model, Path(ccfg["init_from"]))
    ckpt = Checkpointer(run_dir, ccfg, model, optim, _manifest_meta(cfg, report))
    t_resume = time.perf_counter()
    resumed = ckpt.resume()
    resume_s = time.perf_counter() - t_resume
    start = ckpt.train.step
    if resumed is not None:
        log.info("resumed from %s at step %d", resumed, start)
    if rank == 0:  # once the run is sure to go on: a failed resume leaves the earlier plan.json
        log.info("\n%s", format_table(report))
        if (tr["steps"] or start) > start:  # it trains: plan.json is its plan (train.steps=0 keeps the run's)
            write_plan(run_dir / "plan.json", report)

    steps, accum, gb = tr["steps"], tr["grad_accum"], cfg["data"]["batch_size"]
    end = steps or start  # train.steps=0: load, then export or verify, without training
    micro = gb // (world * accum)
    # The data position is the number of samples consumed, so a resumed run takes up the
    # same global batches on any layout (and after a change of data.batch_size).
    first_sample = ckpt.train.samples
    switches = _grad_sync_switches(model) if accum > 1 else []
    keep_unsharded = not cfg["sharding"].get("reshard_after_backward", True)
    metrics = Metrics(run_dir, rank == 0, steps, start, cfg["metrics"]["tensorboard"], cfg["metrics"]["progress"])
    step_times: list[float] = []
    norm: GradNorm | None = None
    first_loss = last_loss = None
    t_first_step = measured = stopped_at = None
    model.train()
    try:
        for step in range(start, end):
            t0 = time.perf_counter()
            lr = set_lr(optim, step, steps, ocfg)
            totals = torch.zeros(2, device=device)  # [loss, stop]
            for m in range(accum):
                # Gradients are reduced only on the last micro-batch (FSDP's own switch);
                # with reshard_after_backward=false, parameters also stay unsharded until
                # then, and are resharded before the optimizer updates the shards.
                last = m == accum - 1
                for s in switches:
                    s.set_requires_gradient_sync(last, recurse=False)
                    if keep_unsharded:
                        s.set_reshard_after_backward(last, recurse=False)
                base = first_sample + (step - start) * gb + m * (gb // accum) + rank * micro
                x, y = data.batch(range(base, base + micro))
                loss = data.loss(model(x.to(device)), y.to(device)) / accum
                loss.backward()
                totals[0] += loss.detach()
            totals[1] = 1.0 if stopping.requested() else 0.0
            # One all-reduce: the global mean loss (also the non-finite stop), whether any rank
            # was asked to stop (agreed by every rank before stepping, with no collective of
            # its own), and the squared grad norm's shares.
            params = [p for p in model.parameters() if p.grad is not None]
            if norm is None or not norm.covers(params):  # the layout is decided once, not every step
                norm = GradNorm(params, totals.dtype, device)
            shares = norm.shares()
            if shares is not None:
                totals = torch.cat([totals, shares])
            dist.all_reduce(totals)
            gnorm_t = norm.total(totals[2:] if shares is not None else None)
            loss_total, stop, gnorm = torch.stack([totals[0], totals[1], gnorm_t.to(totals)]).tolist()  # one host read
            gloss = loss_total / world
            # a request during the last step changes nothing: the run ends with its final save
            if stop > 0 and step + 1 < steps:
                stopped_at = step + 1
            if not math.isfinite(gloss):
                raise NonFiniteLossError(
                    f"loss is {gloss} at step {step + 1}: stopped before the optimizer step; "
                    f"lower optim.lr (now {ocfg['lr']}) or check the data"
                )
            norm.clip_(ocfg["grad_clip"], gnorm_t)
            waited = ckpt.wait_staged()  # an async save's copy of the weights, before they change
            optim.step()
            if measured is None:  # once: what this rank really holds, to set beside the plan
                measured = gather_measured_bytes(model, optim)
            optim.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if t_first_step is None:
                t_first_step = time.perf_counter() - t_start
            first_loss = gloss if first_loss is None else first_loss
            last_loss = gloss
            ckpt.train.step, ckpt.train.samples = step + 1, first_sample + (step + 1 - start) * gb
            row = {
                "step": step + 1,
                "loss": gloss,
                "grad_norm": gnorm,
                "lr": lr,
                "step_s": dt,
                "samples_per_s": gb / dt,
                "peak_mem_bytes": peak_memory_bytes(device),
            }
            if waited:
                row["checkpoint_wait_s"] = waited  # the rest of the previous async save's stall
            if ckpt.due(step + 1, step + 1 == steps) or (stopped_at and ckpt.enabled):
                # the time training waited: the whole save, or, when async, starting it (the
                # wait for its staged copy is the next step's checkpoint_wait_s)
                row["checkpoint_stall_s"] = ckpt.save(step + 1)
            if rank == 0 and (
                (step + 1) % tr["log_every"] == 0
                or step + 1 == steps
                or "checkpoint_stall_s" in row
                or "checkpoint_wait_s" in row
                or stopped_at
            ):
                metrics.log(row)
            metrics.advance()
            if stopped_at:
                break
    finally:
        metrics.close()
    t_finish = time.perf_counter()
    ckpt.close()  # the async save still in flight (a preempted run's too), published
    finish_s = time.perf_counter() - t_finish
    exported = checked = None
    if ccfg["export"] == "safetensors" and not stopped_at:
        exported = export_safetensors(model, run_dir / "export" / "model.safetensors", {"step": str(end)})
    if ccfg.get("verify") and not stopped_at:
        checked = verify({**cfg, "train": {**tr, "steps": end}}, model, optim, data)

    if not step_times and ckpt.last_saved is None and resumed is not None:
        ckpt.last_saved = resumed  # nothing left to train: the resumed checkpoint is the final one
    # Nothing trained in this run (a finished run run again to export, or train.steps=0): its
    # results are those of the run that trained up to here, not none.
    earlier = _earlier_results(run_dir, resumed, end) if not step_times else {}
    wall = time.perf_counter() - t_start
    # the wall clock when the first step ended, for start-up measured from outside the process
    first_end = None if t_first_step is None else time.time() - (time.perf_counter() - t_start - t_first_step)
    summary = {
        "status": "preempted" if stopped_at else "ok",
        "model": report["model"],
        "mesh": report["mesh"],
        "world_size": world,
        "policy": report["policy"],
        "steps": end,
        "start_step": start,
        "preempted_at_step": stopped_at,
        "resumed_from": str(resumed) if resumed else None,
        "first_loss": first_loss if step_times else earlier.get("first_loss"),
        "final_loss": last_loss if step_times else earlier.get("final_loss"),
        "median_step_s": statistics.median(step_times) if step_times else earlier.get("median_step_s"),
        "time_to_first_step_s": t_first_step,
        "first_step_end_unix": first_end,
        "resume_s": resume_s if resumed is not None else None,
        "wall_s": wall,
        "peak_mem_bytes": peak_memory_bytes(device),
        "checkpoint": str(ckpt.last_saved) if ckpt.last_saved else None,
        "checkpoint_finish_s": finish_s,
        "export": str(exported) if exported else None,
        "verify": checked,
        "run_dir": str(run_dir),
        # measured after the first step of this run: params, grads, optimizer state per rank
        "measured_bytes_per_rank": measured,
        "steps_this_run": len(step_times),
    }
    if not step_times and earlier.get("summary"):
        # the summary of the run that trained up to here stays; this command adds what it did
        summary = {**earlier["summary"], "export": summary["export"] or earlier["summary"].get("export")}
        summary.update(verify=checked if checked is not None else summary.get("verify"), steps_this_run=0)
    if stopped_at:
        _preempted(summary, run_dir, rank, ccfg["resume"])
    if rank == 0:
        write_json(run_dir / "summary.json", summary)
        loss_s = f"{summary['final_loss']:.4g}" if summary["final_loss"] is not None else "n/a"
        med = f"{summary['median_step_s'] * 1e3:.1f} ms/step" if summary["median_step_s"] else "no steps run"
        log.info(
            "composerun: done: %s on mesh %s (%s), %d steps, final loss %s, %s, %.1f s; run dir %s",
            summary["model"],
            summary["mesh"],
            summary["policy"],
            end,
            loss_s,
            med,
            wall,
            run_dir,
        )
    if checked is not None and not checked["ok"]:
        raise VerifyError(verify_failure_line(checked))
    return summary


def _earlier_results(run_dir: Path, resumed: Path | None, step: int) -> dict[str, Any]:
    """The results of the run that trained up to `step`: its summary.json (under "summary"),
    when that is a finished run's naming the checkpoint resumed from (by its folder's name: a
    run directory may have moved), else its rows in metrics.jsonl (final loss, median step time)."""
    earlier = read_summary(run_dir) or {}
    same = resumed is not None and Path(earlier.get("checkpoint") or "").name == resumed.name
    if same and earlier.get("status") == "ok":
        return {"summary": earlier, **{k: earlier.get(k) for k in ("first_loss", "final_loss", "median_step_s")}}
    rows = []
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
    except (OSError, ValueError):
        return {}
    last = [r for r in rows if r["step"] == step]
    times = [r["step_s"] for r in rows if isinstance(r.get("step_s"), (int, float))]
    return {
        "final_loss": last[-1].get("loss") if last else None,
        "median_step_s": statistics.median(times) if times else None,
    }


def _preempted(summary: dict[str, Any], run_dir: Path, rank: int, resume: str) -> None:
    """Stop a run that every rank agreed to preempt: its checkpoint is published; say so
    (summary.json, rank 0's log) and leave with the line the launcher shows."""
    summary["signal"] = stopping.requested()  # None where only another rank got it
    newest = find_latest(run_dir / "checkpoints")
    stop = Preempted(run_dir, summary["preempted_at_step"], summary["checkpoint"], resume, summary["signal"], newest)
    if rank == 0:
        write_json(run_dir / "summary.json", summary)
        log.info("composerun: %s", stop)
    raise stop


def _manifest_meta(cfg: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """What every checkpoint's manifest says about the run that wrote it."""

    def digest(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "model": report["model"],
        "model_hash": digest(cfg["model"]),
        "config_hash": digest(cfg),
        "config": cfg,  # a resume with another config says what changed
        "mesh": report["mesh"],
        "policy": report["policy"],
        "plan": {u["fqn"]: u["apis"] for u in report["units"]},
    }
