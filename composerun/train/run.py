"""What every rank runs: the process group and the mesh, then one training run on them.

`run(cfg, run_dir)` takes the resolved, typed config (composerun/config/typed.py); it never
touches Hydra, so the same function serves self-launched ranks, torchrun ranks and one
in-process rank.  It owns the process group; `train(cfg, run_dir, mesh, device)` is one
training run on a mesh that already exists (the tests run many of them on one set of
ranks): set up (train/setup.py), the loop (train/trainer.py), the end (train/summary.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from composerun import stopping
from composerun.config.schema import Config
from composerun.errors import Preempted
from composerun.parallel.mesh import init_mesh, teardown
from composerun.train.setup import set_up
from composerun.train.summary import finish
from composerun.train.trainer import Trainer


def run(cfg: Config, run_dir: str | Path) -> dict[str, Any]:
    # From here on SIGTERM/SIGUSR1 are recorded, not fatal: one that arrives during
    # start-up stops the run after its first step, with a checkpoint.
    with stopping.recording():
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        mesh, device = init_mesh(cfg.mesh)
        try:
            summary = train(cfg, Path(run_dir), mesh, device)
        except Preempted:
            teardown()  # every rank agreed to stop after the same step: none is inside a collective
            raise
        teardown()
    return summary


def train(cfg: Config, run_dir: Path, mesh: DeviceMesh, device: torch.device) -> dict[str, Any]:
    t_start = time.perf_counter()
    setup = set_up(cfg, run_dir, mesh, device)
    trainer = Trainer(setup)
    trainer.loop(t_start)
    return finish(setup, trainer, t_start)
