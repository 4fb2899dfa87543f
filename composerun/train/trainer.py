"""The training loop, in parts a reader can hold in mind:

- `Trainer.step(step)`: one optimizer step: the LR, the micro-batches (forward, backward),
  the step's one all-reduce (global loss, stop request, squared gradient-norm shares), the
  non-finite check, clipping, the optimizer step; returns the step's metrics row;
- `Trainer.loop()`: the steps from the resumed one to the last, and what happens between
  two steps: checkpoints (their cadence and a preemption's), the metrics log, stopping;
- what happens before (train/setup.py) and after (train/summary.py) is elsewhere.

The data position is the number of samples consumed, so a resumed run takes up the same
global batches on any layout (and after a change of data.batch_size).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from composerun import stopping
from composerun.parallel.gradnorm import GradNorm
from composerun.parallel.plan import gather_measured_bytes
from composerun.train.metrics import Metrics, peak_memory_bytes
from composerun.train.optim import set_lr
from composerun.train.setup import Setup


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    def __init__(self, s: Setup) -> None:
        self.s, cfg = s, s.cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.start = s.ckpt.train.step
        self.steps = cfg.train.steps
        self.end = self.steps or self.start  # train.steps=0: load, then export or verify, without training
        self.batch, self.accum = cfg.data.batch_size, cfg.train.grad_accum
        self.micro = self.batch // (self.world * self.accum)
        self.first_sample = s.ckpt.train.samples
        self.switches = [m for m in s.model.modules() if isinstance(m, FSDPModule)] if self.accum > 1 else []
        self.norm: GradNorm | None = None
        # what the run did, for its summary
        self.step_times: list[float] = []
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.t_first_step: float | None = None  # seconds from the start of the run to the end of its first step
        self.measured: dict[str, list[int]] | None = None  # bytes this rank really holds, after the first step
        self.stopped_at: int | None = None  # the step a preemption stopped the run after

    def loop(self, t_start: float) -> None:
        s = self.s
        metrics = Metrics(
            s.run_dir, self.rank == 0, self.steps, self.start, s.cfg.metrics.tensorboard, s.cfg.metrics.progress
        )
        s.model.train()
        try:
            for step in range(self.start, self.end):
                row = self.step(step)
                if self.t_first_step is None:
                    self.t_first_step = time.perf_counter() - t_start
                self._between_steps(row)
                if self.rank == 0 and self._logged(row):
                    metrics.log(row)
                metrics.advance()
                if self.stopped_at:
                    break
        finally:
            metrics.close()

    def _between_steps(self, row: dict[str, Any]) -> None:
        """What happens after step `row["step"]` and before the next: the position a checkpoint
        records, and a checkpoint when one is due (its cadence, the last step, a preemption).
        Work on the updated weights that is not a training step (an evaluation) goes here too;
        what it measures goes into `row`."""
        s, done = self.s, row["step"]
        s.ckpt.train.step, s.ckpt.train.samples = done, self.first_sample + (done - self.start) * self.batch
        if s.ckpt.due(done, done == self.steps) or (self.stopped_at and s.ckpt.enabled):
            # the time training waited: the whole save, or, when async, starting it (the
            # wait for its staged copy is the next step's checkpoint_wait_s)
            row["checkpoint_stall_s"] = s.ckpt.save(done)

    def _logged(self, row: dict[str, Any]) -> bool:
        """Every train.log_every steps, the last one, and any that saved, waited or stopped."""
        step = row["step"]
        keep = ("checkpoint_stall_s", "checkpoint_wait_s")
        return (
            step % self.s.cfg.train.log_every == 0
            or step == self.steps
            or any(k in row for k in keep)
            or bool(self.stopped_at)
        )

    def step(self, step: int) -> dict[str, Any]:
        s, ocfg = self.s, self.s.cfg.optim
        t0 = time.perf_counter()
        lr = set_lr(s.optim, step, self.steps, ocfg)
        totals = torch.zeros(2, device=s.device)  # [loss, stop]
        totals[0] = self._micro_batches(step)
        totals[1] = 1.0 if stopping.requested() else 0.0
        gloss, stop, gnorm, gnorm_t = self._reduce(totals)
        # a request during the last step changes nothing: the run ends with its final save
        if stop > 0 and step + 1 < self.steps:
            self.stopped_at = step + 1
        if not math.isfinite(gloss):
            raise NonFiniteLossError(
                f"loss is {gloss} at step {step + 1}: stopped before the optimizer step; "
                f"lower optim.lr (now {ocfg.lr}) or check the data"
            )
        self.norm.clip_(ocfg.grad_clip, gnorm_t)
        waited = s.ckpt.wait_staged()  # an async save's copy of the weights, before they change
        s.optim.step()
        if self.measured is None:  # once: what this rank really holds, to set beside the plan
            self.measured = gather_measured_bytes(s.model, s.optim)
        s.optim.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.step_times.append(dt)
        self.first_loss = gloss if self.first_loss is None else self.first_loss
        self.last_loss = gloss
        row = {
            "step": step + 1,
            "loss": gloss,
            "grad_norm": gnorm,
            "lr": lr,
            "step_s": dt,
            "samples_per_s": self.batch / dt,
            "peak_mem_bytes": peak_memory_bytes(s.device),
        }
        if waited:
            row["checkpoint_wait_s"] = waited  # the rest of the previous async save's stall
        return row

    def _micro_batches(self, step: int) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of the step's global batch; the
        sum of their losses (each divided by the count, as one batch's mean)."""
        s = self.s
        keep_unsharded = not s.cfg.sharding.reshard_after_backward
        total = torch.zeros((), device=s.device)
        for m in range(self.accum):
            # Gradients are reduced only on the last micro-batch (FSDP's own switch); with
            # reshard_after_backward=false, parameters also stay unsharded until then, and
            # are resharded before the optimizer updates the shards.
            last = m == self.accum - 1
            for unit in self.switches:
                unit.set_requires_gradient_sync(last, recurse=False)
                if keep_unsharded:
                    unit.set_reshard_after_backward(last, recurse=False)
            base = self.first_sample + (step - self.start) * self.batch + m * (self.batch // self.accum)
            base += self.rank * self.micro
            x, y = s.data.batch(range(base, base + self.micro))
            loss = s.data.loss(s.model(x.to(s.device)), y.to(s.device)) / self.accum
            loss.backward()
            total += loss.detach()
        return total

    def _reduce(self, totals: torch.Tensor) -> tuple[float, float, float, torch.Tensor]:
        """One all-reduce: the global mean loss (also the non-finite stop), whether any rank
        was asked to stop (agreed by every rank before stepping, with no collective of its
        own), and the squared grad norm's shares.  (global loss, stop, grad norm, the norm
        as a tensor for clipping)."""
        params = [p for p in self.s.model.parameters() if p.grad is not None]
        if self.norm is None or not self.norm.covers(params):  # the layout is decided once, not every step
            self.norm = GradNorm(params, totals.dtype, self.s.device)
        shares = self.norm.shares()
        if shares is not None:
            totals = torch.cat([totals, shares])
        dist.all_reduce(totals)
        gnorm_t = self.norm.total(totals[2:] if shares is not None else None)
        loss_total, stop, gnorm = torch.stack([totals[0], totals[1], gnorm_t.to(totals)]).tolist()  # one host read
        return loss_total / self.world, stop, gnorm, gnorm_t
