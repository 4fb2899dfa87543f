"""The training loop, in parts a reader can hold in mind:

- `Trainer.step(step)`: one optimizer step: the LR, the micro-batches (forward, backward),
  the step's one all-reduce (global loss, stop request, squared gradient-norm shares),
  clipping, the optimizer step, and, on the steps that need them, the host's read of the
  step's values (the non-finite check, the stop agreement, the metrics row);
- `Trainer.loop()`: the steps from the resumed one to the last, and what happens between
  two steps: evaluations, the metrics log, checkpoints (their cadence and a preemption's;
  a step's row is written before its save can be resumed from), stopping;
- what happens before (train/setup.py) and after (train/summary.py) is elsewhere.

The data position is the number of samples consumed, so a resumed run takes up the same
global batches on any layout (and after a change of data.batch_size).  Each data-parallel
replica (parallel/mesh.py `DataParallel`) takes its slice of every global batch.

Nothing in a step waits for the device before the optimizer step: the loss, the stop
request and the gradient norm stay on the device, and the host reads them after it, once,
only on a step that logs, saves, or ends the run (and the first).  A non-finite loss or
gradient norm is tracked on the device from the step it first appears, and the read that
finds it stops the run before anything is saved (a save is due only on a step that reads).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from composerun import _torch_compat as compat
from composerun import stopping
from composerun.config.schema import micro_batch_of
from composerun.data.loader import Loader, default_workers, micro_batch_order
from composerun.data.sources import counted, forward, summed_loss, token_ids
from composerun.parallel.apply import (
    MicroBatchSwitches,
    align_grads,
    float8_all_gathers,
    local_value,
    loss_context,
    loss_parallel,
    misaligned_grads,
)
from composerun.parallel.float8 import precompute_scales
from composerun.parallel.gradnorm import GradNorm
from composerun.parallel.plan import gather_measured_bytes
from composerun.train.evaluate import Evaluator
from composerun.train.memory import MemoryProbe
from composerun.train.mesh_change import first_row_field, mesh_change
from composerun.train.metrics import Metrics, peak_memory_bytes
from composerun.train.optim import set_lr
from composerun.train.profile import keep_memory_history, out_of_memory, step_profiler
from composerun.train.setup import Setup
from composerun.train.throughput import Throughput, peak_flops

# The most steps a preemption request waits for the ranks to agree on it (each agreement is
# one host read of the step's values: nothing a GPU waits for on the other steps).
STOP_EVERY = 10
GPU_LOG_EVERY = 10  # train.log_every's null on a GPU (torchtitan's interval too)


def log_interval(log_every: int | None, device: torch.device) -> int:
    """train.log_every, its null resolved: every step on a CPU mesh (the host is the device:
    a read costs nothing), every GPU_LOG_EVERY on a GPU, where each read waits for the step to
    end and the host could otherwise queue the next step's all-gathers ahead of it."""
    if log_every is not None:
        return log_every
    return 1 if device.type == "cpu" else GPU_LOG_EVERY


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is inf or NaN: the run stops, saving nothing after it."""


class Trainer:
    def __init__(self, setup: Setup) -> None:
        self.setup, cfg = setup, setup.cfg
        self.rank, self.dp = dist.get_rank(), setup.dp
        self.start = setup.ckpt.train.step
        self.steps = cfg.train.steps
        self.end = self.steps or self.start  # train.steps=0: load, then export or verify, without training
        self.batch, self.accum = cfg.data.batch_size, cfg.train.grad_accum
        self.log_every = log_interval(cfg.train.log_every, setup.device)
        self.micro = micro_batch_of(cfg)
        self.first_sample = setup.ckpt.train.samples
        self.switches = MicroBatchSwitches(setup.model, cfg.sharding, self.accum)  # gradient accumulation's
        self.norm: GradNorm | None = None
        self.misaligned: list[torch.nn.Parameter] | None = None  # gradients placed unlike their parameters
        self.first_bad: torch.Tensor | None = None  # [step, loss, grad norm] of the first non-finite step
        self.batches: Loader | None = None
        self.t_read, self.unread = 0.0, 0  # when the host last read a step's values; steps since
        self.outside = 0.0  # seconds spent between steps since then (saves), not step time
        # what the run did, for its summary
        self.step_times: list[float] = []
        self.graphs_at_start = compat.compiled_graphs()  # torch.compile's, in this process
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.t_first_step: float | None = None  # seconds from the start of the run to the end of its first step
        # resumed on another mesh than the checkpoint's (rank 0 records it): train/mesh_change.py
        self.changed = None if self.rank else mesh_change(setup.resumed, self.start, setup.report["mesh"], self.accum)
        self.measured: dict[str, list[int]] | None = None  # bytes this rank really holds, after the first step
        self.stopped_at: int | None = None  # the step a preemption stopped the run after
        self.memory = MemoryProbe(setup.model, setup.optim, setup.device, self.start, self.end, cfg.metrics.track_memory)
        self.loss_parallel = loss_parallel(setup.units)  # the loss of logits sharded over `tp`
        self.float8_scales = float8_all_gathers(setup.units)  # float8 weights' scales, after each optimizer step
        self.evaluator = Evaluator(cfg, setup.model, setup.data, setup.device, setup.dp, self.loss_parallel)  # train/evaluate.py
        tokens = cfg.model.task.value == "tokens"
        peak = peak_flops(cfg.metrics.peak_flops, setup.device)
        self.throughput = Throughput(setup.model, tokens, self.batch, dist.get_world_size(), peak)

    def loop(self, t_start: float) -> None:
        setup = self.setup
        metrics = Metrics(setup.cfg, setup.run_dir, self.rank == 0, self.start, setup.report)
        order = micro_batch_order(
            self.first_sample, range(self.start, self.end), self.batch, self.accum, self.micro, self.dp.rank
        )
        dcfg = setup.cfg.data  # workers seeded from (data.seed, replica): data/loader.py
        workers = default_workers(dcfg.workers, dcfg.prefetch, setup.device)
        self.batches = Loader(setup.data, order, setup.device, dcfg.prefetch, workers, dcfg.seed * 1_000_003 + self.dp.rank)
        setup.model.train()
        # profile.*: a profiler only over profile.steps, the GPU allocator's history (train/profile.py)
        profiler = step_profiler(setup.cfg.profile, setup.run_dir, self.rank, self.start, setup.device)
        history = keep_memory_history(setup.cfg.profile, setup.device)
        self.t_read = time.perf_counter()
        try:
            for step in range(self.start, self.end):
                if profiler is not None:
                    profiler.begin(step + 1)
                try:
                    with self.memory.around(step):  # the tracker on one step: train/memory.py
                        row = self.step(step)
                except torch.OutOfMemoryError as e:
                    raise out_of_memory(e, step + 1, setup.run_dir, self.rank, setup.device, history) from e
                if profiler is not None:
                    profiler.end(step + 1)
                if self.memory.at == step + 1:
                    row["memory_tracked"] = True
                if self.t_first_step is None:
                    self.t_first_step = time.perf_counter() - t_start
                    if self.changed is not None:
                        row["mesh_change"] = first_row_field(self.changed)  # (and rank 0's log line)
                t0 = time.perf_counter()
                self._between_steps(row, metrics)  # (the row is logged there)
                self.outside += time.perf_counter() - t0
                metrics.advance()
                if self.stopped_at:
                    break
        finally:
            if profiler is not None:
                profiler.close()
            self.batches.close()
            metrics.close()

    def _between_steps(self, row: dict[str, Any], metrics: Metrics) -> None:
        """What happens after step `row["step"]` and before the next: the position a checkpoint
        records, work on the updated weights that is not a training step (an evaluation, which
        adds to `row`), the step's metrics row, and a checkpoint when one is due (its cadence,
        the last step, a preemption).  (A save is due only on a step whose values the host
        read: `_reads`.)

        The row is written before the save can become the one a run resumes from (recorded by
        every rank, or published): the save calls back to write it once its data is written
        (sync) or started (async), with the stall up to then.  A run killed after that keeps
        the row of the step it resumes at; one killed before resumes earlier, and the rows
        after that step are dropped (train/metrics.py)."""
        setup, done = self.setup, row["step"]
        setup.ckpt.train.step, setup.ckpt.train.samples = done, self.first_sample + (done - self.start) * self.batch
        setup.ckpt.poll()  # an async save every rank has written is published now, not at the next save
        if self.evaluator.due(done) and not self.stopped_at:  # (a preempted run saves and stops)
            t0 = time.perf_counter()
            row.update(self.evaluator.run(done))  # (it changes nothing a checkpoint holds)
            row["eval_s"] = time.perf_counter() - t0  # (outside the steps' time: see self.outside)
        if not (setup.ckpt.due(done, done == self.steps) or (self.stopped_at and setup.ckpt.enabled)):
            self._log(row, metrics)
            return

        def written(stall: float) -> None:
            # the time training waited: the save so far, or, when async, starting it (the
            # wait for its staged copy is the next step's checkpoint_wait_s)
            row["checkpoint_stall_s"] = stall
            self._log(row, metrics)

        setup.ckpt.save(done, written)

    def _log(self, row: dict[str, Any], metrics: Metrics) -> None:
        if self.rank == 0 and self._logged(row):
            metrics.log(row)

    def _logged(self, row: dict[str, Any]) -> bool:
        """Every train.log_every steps, the first and the last, and any that saved, waited,
        evaluated or stopped (all of them steps the host read)."""
        done = row["step"]
        return "loss" in row and (
            done % self.log_every == 0
            or done in (self.start + 1, self.end)
            or any(k in row for k in ("checkpoint_stall_s", "checkpoint_wait_s", "val_loss"))
            or bool(self.stopped_at)
        )

    def _reads(self, done: int, waited: float) -> bool:
        """Whether the host reads step `done`'s values: the metrics log's steps, the first and
        the last, a step a save or an evaluation is due after or that waited for a save, and at least every
        STOP_EVERY steps: a preemption request is agreed at the next such step (the stop flag
        stays set until then), so a large train.log_every does not delay it past a scheduler's
        grace period."""
        return (
            done % self.log_every == 0
            or done % STOP_EVERY == 0
            or done in (self.start + 1, self.end)
            or self.setup.ckpt.due(done, done == self.steps)
            or waited > 0
            or self.evaluator.due(done)
        )

    def step(self, step: int) -> dict[str, Any]:
        setup, ocfg = self.setup, self.setup.cfg.optim
        lr = set_lr(setup.optim, step, self.steps, ocfg)
        totals = torch.zeros(2, device=setup.device)  # [loss, stop]
        totals[0] = self._micro_batches()
        self._align_grads()
        totals[1] = 1.0 if stopping.requested() else 0.0
        gloss, stop, gnorm = self._reduce(totals)
        self._track_non_finite(step, gloss, gnorm)
        self.norm.clip_(ocfg.grad_clip, gnorm)
        waited = setup.ckpt.wait_staged()  # an async save's copy of the weights, before they change
        setup.optim.step()
        if self.float8_scales:
            precompute_scales(setup.model)
        if self.measured is None:  # once: what this rank really holds, to set beside the plan
            self.measured = gather_measured_bytes(setup.model, setup.optim)
        setup.optim.zero_grad(set_to_none=True)
        self.unread += 1
        row: dict[str, Any] = {"step": step + 1, "lr": lr}
        if waited:
            row["checkpoint_wait_s"] = waited  # the rest of the previous async save's stall
        if self._reads(step + 1, waited):
            self._read(row, gloss, stop, gnorm)
        return row

    def _read(self, row: dict[str, Any], gloss: torch.Tensor, stop: torch.Tensor, gnorm: torch.Tensor) -> None:
        """The host's one read of the device's values (waiting for the steps queued so far):
        the non-finite check, the stop agreement, the metrics row."""
        values = torch.cat([torch.stack([gloss, stop, gnorm.to(gloss)]), self.first_bad]).tolist()
        loss, stop_f, norm, bad_step, bad_loss, bad_norm = values
        if self._norm_may_differ():  # every rank must stop at the same step, or the others hang
            agreed = torch.tensor([bad_step], device=gloss.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            bad_step = bad_step or float(agreed.item())
        if bad_step:
            raise non_finite(int(bad_step), bad_loss, bad_norm, self.setup.cfg.optim.lr)
        now = time.perf_counter()
        dt = (now - self.t_read - self.outside) / self.unread  # each step's share since the last read
        self.step_times += [dt] * self.unread
        self.t_read, self.unread, self.outside = now, 0, 0.0
        # a request during the last step changes nothing: the run ends with its final save
        if stop_f > 0 and row["step"] < self.steps:
            self.stopped_at = row["step"]
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        row.update(loss=loss, grad_norm=norm, step_s=dt, samples_per_s=self.batch / dt)
        row.update(self.throughput.rates(dt))  # tokens/s, FLOPs per token, MFU: train/throughput.py
        row["peak_mem_bytes"] = peak_memory_bytes(self.setup.device)

    def _norm_may_differ(self) -> bool:
        """Whether the ranks' gradient norms may differ (a group reduced over a sub-mesh, or
        gradients of no unit's, with sharding.require_coverage=false): then the non-finite
        stop is agreed in a collective of its own on the steps the host reads.  (replicate's
        gradients, all-reduced in backward, are the same on every rank.)"""
        if dist.get_world_size() == 1:
            return False
        return not self.setup.cfg.sharding.require_coverage or any(g.kind == "separate" for g in self.norm.groups)

    def _track_non_finite(self, step: int, gloss: torch.Tensor, gnorm: torch.Tensor) -> None:
        """Remember, on the device, the first step whose loss or gradient norm (before
        clipping) is not finite, with both values."""
        now = torch.stack([gloss.new_full((), float(step + 1)), gloss, gnorm.to(gloss)])  # (a fill: no host sync)
        if self.first_bad is None:
            self.first_bad = torch.zeros(3, device=gloss.device)
        fresh = (self.first_bad[0] == 0) & ~torch.isfinite(now[1:]).all()
        self.first_bad = torch.where(fresh, now, self.first_bad)

    def _micro_batches(self) -> torch.Tensor:
        """Forward and backward of this replica's micro-batches of the step's global batch;
        the sum of their losses, each its sum over the targets that count divided by the count
        of the whole global batch (`_global_count`): the token-weighted mean, not a mean of
        per-rank or per-micro-batch means.  Backward takes that times the data-parallel size,
        since FSDP and DDP average the gradients over the replicas."""
        setup = self.setup
        batches = [self.batches.next() for _ in range(self.accum)]  # (their count comes first)
        count = self._global_count([y for _, y in batches])
        total = torch.zeros((), device=setup.device)
        for m, (x, y) in enumerate(batches):
            if m:
                self.memory.next_micro_batch()  # (on the step whose memory is measured)
            self.switches.set(m == self.accum - 1)
            self.throughput.observe(token_ids(x))
            with loss_context(self.loss_parallel):  # vocabulary-sharded logits: forward and backward
                part = local_value(summed_loss(setup.data, forward(setup.model, x), y)) / count
                (part * self.dp.size).backward()
            total += part.detach()
        return total

    def _global_count(self, targets: list[torch.Tensor]) -> torch.Tensor:
        """The targets that count in the step's global batch (every replica, every micro-batch).
        A source whose every target counts (data/sources.py) needs no communication: each
        replica's micro-batches have the same shape, so the count is this replica's times the
        replicas.  Else one all-reduce of the count, on the device, summed over the replicas'
        first ranks (a tensor-parallel peer holds the same targets)."""
        local = torch.stack([counted(self.setup.data, y) for y in targets]).sum()
        if getattr(self.setup.data, "every_target_counts", False) or dist.get_world_size() == 1:
            return (local * self.dp.size).to(torch.float32)
        if not self.dp.owner:
            local = torch.zeros_like(local)
        dist.all_reduce(local)
        return local.clamp(min=1).to(torch.float32)  # (a batch with nothing to count: a zero loss, not NaN)

    def _align_grads(self) -> None:
        """Give each gradient its parameter's placements where tensor parallelism left another
        (DTensor's backward leaves a norm's gradient Partial over `tp`, a vocabulary-split
        embedding's Replicate and whole): a sum over `tp` for the first, this rank's rows of
        the second.  The optimizer, the clipping and the memory are then the parameter's
        (FSDP does the same for the units it shards).  Which parameters need it is found on
        the first step: the layout does not change."""
        if self.misaligned is None:
            self.misaligned = misaligned_grads(self.setup.model)
        align_grads(self.misaligned)

    def _reduce(self, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One all-reduce: the global batch's loss (each replica's share of the token-weighted
        mean, summed), whether any rank was asked to stop, and the squared grad norm's shares.
        (global loss, stop, grad norm), on the device."""
        params = [p for p in self.setup.model.parameters() if p.grad is not None]
        if self.norm is None or not self.norm.covers(params):  # the layout is decided once, not every step
            self.norm = GradNorm(params, totals.dtype, self.setup.device)
        if not self.dp.owner:  # a tensor-parallel peer of the replica's first rank: same loss
            totals[0] = 0.0
        shares = self.norm.shares()
        if shares is not None:
            totals = torch.cat([totals, shares])
        dist.all_reduce(totals)
        gnorm = self.norm.total(totals[2:] if shares is not None else None)
        return totals[0], totals[1], gnorm


def non_finite(step: int, loss: float, norm: float, lr: float) -> NonFiniteError:
    what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm} (the loss, {loss:.4g}, is finite)"
    return NonFiniteError(
        f"{what} at step {step}: stopped, nothing after step {step - 1} is saved; lower optim.lr (now {lr}), "
        "keep sharding.reduce_dtype=float32 with bf16, or check the data"
    )
