"""What every rank runs: the process group and the mesh, then one training run on them.

`run(cfg, run_dir, start)` takes the resolved, typed config (composerun/config/typed.py) and
where the run starts, as the launching process decided it before any rank started
(checkpoint/start.py: the checkpoint to load, or none); it never touches Hydra, so the same
function serves self-launched ranks, torchrun ranks and one in-process rank (each enters it through launch/rank.py's run_rank).  It owns the
process group; `train(cfg, run_dir, mesh, device, start)` is one training run on a mesh that
already exists (the tests run many of them on one set of ranks): set up (train/setup.py),
the loop (train/trainer.py), the end (train/summary.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from composerun import stopping
from composerun.checkpoint.start import Start
from composerun.config.schema import Config
from composerun.errors import Preempted
from composerun.parallel.mesh import init_mesh, teardown
from composerun.train import flight_recorder
from composerun.train.setup import set_up
from composerun.train.summary import finish
from composerun.train.trainer import Trainer


def run(cfg: Config, run_dir: str | Path, start: Start) -> dict[str, Any]:
    # From here on SIGTERM/SIGUSR1 are recorded, not fatal: one that arrives during
    # start-up stops the run after its first step, with a checkpoint.
    # A collective that times out leaves the flight recorder's dump and one line (train/flight_recorder.py).
    with stopping.recording(), flight_recorder.armed(cfg, Path(run_dir)):
        mesh, device = init_mesh(cfg.mesh, cfg.launch.collective_timeout)
        set_determinism(cfg.train.deterministic, device)
        try:
            with flight_recorder.watching(cfg, Path(run_dir)):
                summary = train(cfg, Path(run_dir), mesh, device, rank0s(start))
        except Preempted:
            teardown()  # every rank agreed to stop after the same step: none is inside a collective
            raise
        except RuntimeError as e:
            hung = flight_recorder.timed_out(e, cfg, Path(run_dir), dist.get_rank())
            if hung is None:
                raise
            raise hung from e
        teardown()
    return summary


def rank0s(start: Start) -> Start:
    """The start rank 0 was handed, on every rank.  Where every rank's launcher is the same
    process it is the same object already; the other nodes of a SLURM job and the other
    ranks under torchrun made the same decision from the files without writing them, and a
    save that rank 0's recovery published meanwhile would be one they did not see."""
    if dist.get_world_size() == 1:
        return start
    box = [start]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def set_determinism(deterministic: bool | None, device: torch.device) -> bool:
    """torch's deterministic algorithms for `train.deterministic` (null: on for CPU, off on
    GPUs), without torch's filling of every new tensor (`fill_uninitialized_memory`, which
    deterministic mode turns on): composerun reads no memory it has not written, and the fill
    cost a quarter of a CPU step (BENCHMARKS.md).  Whether they are on."""
    on = device.type == "cpu" if deterministic is None else deterministic
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    return on


def train(cfg: Config, run_dir: Path, mesh: DeviceMesh, device: torch.device, start: Start = Start()) -> dict[str, Any]:
    """One training run from `start` (the default: from the initial weights, no checkpoint)."""
    t_start = time.perf_counter()
    setup = set_up(cfg, run_dir, mesh, device, start)
    trainer = Trainer(setup)
    trainer.loop(t_start)
    return finish(setup, trainer, t_start)
