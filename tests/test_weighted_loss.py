"""The loss is the mean over the global batch's targets that count, weighted by them: not a
mean of the ranks' or micro-batches' means.  A source whose targets are masked unevenly
(tests/fixtures/maskeddata.py: from one counted target in a sample to all of them) trains on
mesh 2 with two micro-batches a step, and its logged losses and trained weights are those of
a plain torch loop written here: one process, the whole global batch, F.cross_entropy with
ignore_index (its own token-weighted mean), torch.optim.SGD (no moment normalises away a
wrong scale of the gradients).  The same loop with the mean of the four pieces' means lands
measurably elsewhere: the comparison can tell the two apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import compose, final_weights, read_metrics, train
from fixtures.maskeddata import UnevenMasks, span_of
from safetensors.torch import save_file

from composerun.models import build_model

pytestmark = pytest.mark.distributed

LR, STEPS, BATCH, ACCUM, RANKS = 0.5, 2, 8, 2, 2
OVERRIDES = (
    "+model=transformer",
    "model.dim=32",
    "model.n_layers=2",
    "model.seq_len=8",
    "data._target_=fixtures.maskeddata.UnevenMasks",
    f"data.batch_size={BATCH}",
    "optim=sgd",
    f"optim.lr={LR}",
    "optim.kwargs.momentum=0.0",
    "optim.grad_clip=0",
    f"train.steps={STEPS}",
    f"train.grad_accum={ACCUM}",
)


def pieces(step: int) -> list[list[int]]:
    """The sample indices of each (micro-batch, rank) piece of a step's global batch."""
    micro = BATCH // ACCUM // RANKS
    first = step * BATCH
    return [
        list(range(first + m * BATCH // ACCUM + r * micro, first + m * BATCH // ACCUM + (r + 1) * micro))
        for m in range(ACCUM)
        for r in range(RANKS)
    ]


def reference(start: dict[str, torch.Tensor], weighted: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(the loss of each step, the final weights) of one process's SGD loop: the token-weighted
    mean over each global batch, or (weighted=False) the mean of its pieces' means."""
    cfg = compose(*OVERRIDES, validate=False)
    model = build_model(cfg.model)
    model.load_state_dict(start)
    data = UnevenMasks(cfg.model, seed=cfg.data.seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        if weighted:
            x, y = data.batch([i for p in pieces(step) for i in p])
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        else:
            parts = [data.batch(p) for p in pieces(step)]
            loss = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100) for x, y in parts)
            loss = loss / len(parts)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_uneven_masks_over_ranks_and_micro_batches_give_the_token_weighted_mean(tmp_path: Path) -> None:
    cfg = compose(*OVERRIDES, validate=False)
    counts = [
        sum(hi - lo for lo, hi in (span_of(cfg.data.seed, i, 8) for i in p)) for s in range(STEPS) for p in pieces(s)
    ]
    assert len(set(counts)) > 2, f"the pieces' counts of targets are too even to test anything: {counts}"
    torch.manual_seed(0)
    start = {k: v.detach().clone().contiguous() for k, v in build_model(cfg.model).state_dict().items()}
    save_file(start, tmp_path / "start.safetensors")
    ov = (*OVERRIDES, f"checkpoint.init_from={tmp_path / 'start.safetensors'}")
    train(tmp_path / "run", *ov, "mesh=2", "sharding=fsdp")
    got_losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    got = final_weights(tmp_path / "run", *ov)

    want_losses, want = reference(start, weighted=True)
    means_losses, means = reference(start, weighted=False)
    assert got_losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert abs(means_losses[-1] - want_losses[-1]) > 1e-2, (means_losses, want_losses)
    moved = max((means[k] - want[k]).abs().max().item() for k in want)
    assert moved > 1e-2, f"the mean of means trains the same weights (max diff {moved}): the test sees nothing"
