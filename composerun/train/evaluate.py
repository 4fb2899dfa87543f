"""Validation loss on the held-out split: `eval.every=N eval.batches=M`.

After every N-th step and after the last one, the model computes the loss of the data
source's held-out source (`data.val`: `.batch(indices)`, `.size`) on the same samples every
time: global batches k = 0..M-1 of `eval.batch_size` (B, null: data.batch_size) samples,
sample indices k*B .. k*B+B-1 wrapped modulo `val.size`.  Each data-parallel replica takes
its contiguous share of each global batch, as training does (parallel/mesh.py
`DataParallel`), in pieces of at most the training micro-batch's size (the memory a step's
forward is known to fit).

The value is the mean over the targets that count in all M*B sequences, as training's loss
is (data/sources.py): each piece's loss summed over its counted targets (the train source's
`loss_sum`) and its count of them, summed and all-reduced together.  Every counted token
weighs the same whatever piece, rank or batch it is in (a piece of mostly masked targets
weighs little), and the result is the same on every mesh (up to float summation order).
Perplexity is exp(val_loss).

It runs in `torch.no_grad()` with the model in eval mode, and consumes no random numbers (a
held-out source draws its samples from (seed, index), as the training sources do): a run
with evaluation trains and saves exactly what one without does.  Compiled modules run their
forward eagerly here: a no-grad forward, and every other piece size, would each be a new
graph for the compiler (a recompilation at the first evaluation, more at uneven pieces, and
shapes marked dynamic for the training graphs after them), for a pass that runs seldom.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from composerun.config.schema import Config, dp_size_of, micro_batch_of
from composerun.data.sources import counted, forward, summed_loss
from composerun.errors import ConfigError
from composerun.parallel.apply import local_value, loss_context


def check_eval(cfg: Config, data: Any) -> None:
    """The eval config against the data source, before any rank starts: one line naming the key."""
    ev = cfg.eval
    if ev.every < 0:
        raise ConfigError(f"eval.every={ev.every}: must be 0 (no evaluation) or a step interval")
    if ev.every == 0:
        return
    if ev.batches < 1:
        raise ConfigError(f"eval.batches={ev.batches}: evaluate at least 1 batch, or set eval.every=0")
    dp = dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
    batch = ev.batch_size or cfg.data.batch_size
    if batch < 1 or batch % dp:
        raise ConfigError(
            f"eval.batch_size={batch} must be a positive multiple of the {dp} data-parallel ranks (each takes a share)"
        )
    val = getattr(data, "val", None)
    if val is None:
        raise ConfigError(
            f"eval.every={ev.every}: data._target_={cfg.data._target_} has no held-out split to evaluate on; "
            "give one (data.val_fraction or data.val_path, where the source takes them) or set eval.every=0"
        )
    if getattr(val, "size", 0) < 1:
        raise ConfigError(f"eval.every={ev.every}: the held-out split of data._target_={cfg.data._target_} is empty")


class Evaluator:
    """The validation loss of one run's model, on its data-parallel share, every `eval.every` steps."""

    def __init__(
        self, cfg: Config, model: torch.nn.Module, data: Any, device: torch.device, dp: Any, loss_parallel: bool = False
    ) -> None:
        self.loss_parallel = loss_parallel  # the model's logits are sharded over `tp` (parallel/apply.py)
        self.every, self.last = cfg.eval.every, cfg.train.steps
        self.model, self.data, self.device, self.dp = model, data, device, dp
        self.batches = cfg.eval.batches
        self.batch = cfg.eval.batch_size or cfg.data.batch_size
        self.share = self.batch // dp.size
        self.piece = micro_batch_of(cfg)  # evaluation's pieces: the training micro-batch
        self.history: list[tuple[int, float]] = []  # (step, val_loss) of this run's evaluations
        if self.every > 0:
            check_eval(cfg, data)  # again on the ranks: under torchrun no launcher checked it

    def due(self, done: int) -> bool:
        """Whether an evaluation follows step `done`: every `eval.every` steps and the last."""
        return self.every > 0 and (done % self.every == 0 or done == self.last)

    def indices(self) -> Iterator[list[int]]:
        """This replica's pieces of every global batch of the held-out split, in order."""
        size = self.data.val.size
        for k in range(self.batches):
            first = k * self.batch + self.dp.rank * self.share
            for start in range(first, first + self.share, self.piece):
                stop = min(start + self.piece, first + self.share)
                yield [i % size for i in range(start, stop)]

    def run(self, done: int) -> dict[str, float]:
        """Evaluate now (every rank, collectively): {"val_loss", "val_ppl"}."""
        val, was_training = self.data.val, self.model.training
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [sum of the loss, targets counted]
        self.model.eval()
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                for idx in self.indices():
                    x, y = val.batch(idx)
                    x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                    with loss_context(self.loss_parallel):
                        loss = local_value(summed_loss(self.data, forward(self.model, x), y))
                    totals[0] += loss.double()
                    totals[1] += counted(self.data, y).double()
        finally:
            self.model.train(was_training)
        if not self.dp.owner:  # a tensor-parallel peer computed its replica's share too: counted once
            totals.zero_()
        dist.all_reduce(totals)
        loss, count = totals.tolist()
        val_loss = loss / max(count, 1.0)
        self.history.append((done, val_loss))
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (a loss above ~709) rather than an error."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def val_summary(history: list[tuple[int, float]], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's validation keys: the best loss (and its step) and the last, over this
    run's evaluations and `earlier` metrics rows (those of the run it resumed, up to its step)."""
    points = [(r["step"], r["val_loss"]) for r in earlier if isinstance(r.get("val_loss"), (int, float))]
    points = sorted(dict(points + history).items())
    if not points:
        return {}
    best_step, best = min(points, key=lambda p: (p[1], p[0]))
    last_step, last = points[-1]
    return {
        "best_val_loss": best,
        "best_val_step": best_step,
        "last_val_loss": last,
        "last_val_ppl": perplexity(last),
        "last_val_step": last_step,
    }
