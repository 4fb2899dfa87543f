"""What torch.compile compiles in a run, counted (summary.json's compiled_graphs, dynamo's own
counter): the compiled blocks' graphs, once; an evaluation (a no-grad forward, in pieces of
another size than training's) compiles nothing, and training after it recompiles nothing; the
step metrics.track_memory measures (under a dispatch mode, where torch.compile compiles nothing)
runs the blocks eagerly, fullgraph or not.

One rank in this process (the compiler's counters are per process), the compile rule on
`aot_eager` (dynamo's graphs and guards as with inductor, without the C++ compile time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo
from conftest import compose

from composerun import _torch_compat as compat
from composerun.train.run import train

pytestmark = pytest.mark.distributed

LLAMA = ["+model=llama3_debug", "model.dim=64", "model.n_layers=2", "model.seq_len=16", "model.kwargs.ffn_dim=128"]
COMPILED = [
    "sharding.rules=[{match: 'layers.*', api: compile, backend: aot_eager}, "
    "{match: 'layers.*', api: fully_shard}, {match: '<root>', api: fully_shard}]"
]
COMMON = ["train.steps=4", "data.batch_size=4", "metrics.progress=false", "metrics.track_memory=false"]
# 6 held-out sequences a batch in pieces of the training micro-batch, 4: pieces of 4 and 2
EVAL = ["eval.every=1", "eval.batch_size=6", "eval.batches=2"]


def _run(mesh, tmp_path: Path, name: str, *overrides: str) -> dict:
    torch._dynamo.reset()  # every run compiles from nothing: its count is its own
    cfg = compose(*LLAMA, *COMPILED, *COMMON, *overrides)
    return train(cfg, tmp_path / name, mesh, torch.device("cpu"))


def test_evaluation_compiles_no_graph(mesh, tmp_path: Path) -> None:
    plain = _run(mesh, tmp_path, "plain")
    evaluated = _run(mesh, tmp_path, "evaluated", *EVAL)
    assert plain["compiled_graphs"] >= 1  # the blocks ran compiled
    assert evaluated["last_val_loss"] is not None and evaluated["last_val_step"] == 4
    # four evaluations, each with pieces of 4 and 2 under no_grad, between training steps
    assert evaluated["compiled_graphs"] == plain["compiled_graphs"], (plain["compiled_graphs"], evaluated["compiled_graphs"])
    assert evaluated["final_loss"] == plain["final_loss"]  # evaluation changes no training


def test_the_counter_sees_a_recompilation() -> None:
    """The counter the summary reads counts every graph: a new grad mode is one more."""
    torch._dynamo.reset()
    before = compat.compiled_graphs()
    f = torch.compile(lambda x: x * 2, backend="aot_eager")
    f(torch.ones(3, requires_grad=True))
    with torch.no_grad():
        f(torch.ones(3, requires_grad=True))
    assert compat.compiled_graphs() - before == 2


def test_fullgraph_blocks_run_the_memory_tracked_step(mesh, tmp_path: Path) -> None:
    """metrics.track_memory's step runs under a dispatch mode, where torch.compile compiles
    nothing (and with fullgraph raises): the blocks run it eagerly, the other steps compiled,
    and the run trains as the same blocks compiled without the tracker."""
    fullgraph = ["sharding.rules.0.fullgraph=true"]
    plain = _run(mesh, tmp_path, "plain", *fullgraph)
    tracked = _run(mesh, tmp_path, "tracked", *fullgraph, "metrics.track_memory=true")
    assert tracked["measured_peak_step"] == 2 and tracked["measured_peak_bytes_per_rank"][0] > 0
    assert tracked["compiled_graphs"] == plain["compiled_graphs"] >= 1
    assert abs(tracked["final_loss"] - plain["final_loss"]) <= 1e-6


def test_compile_runs_eagerly_under_a_dispatch_mode() -> None:
    """The check compile.py asks, against torch.compile itself: with fullgraph it raises under a
    dispatch mode that is not its own (outside one it compiles: the test above)."""

    class Seen(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    assert not compat.compile_runs_eagerly()
    with Seen():
        assert compat.compile_runs_eagerly()
        with pytest.raises(RuntimeError, match="no compiled frames"):
            torch.compile(lambda x: x * 2, backend="aot_eager", fullgraph=True)(torch.ones(3))
    assert not compat.compile_runs_eagerly()
