"""The one door into a rank's run (train/run.py): `run_rank`, whoever started the rank
(torchrun, composerun's agent, or the launching process itself for one rank) sets up its logs
and its error reporting here.  What a self-launched rank does before it (its signal handlers,
the watch on its launcher) is `rank_entry`'s."""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composerun.config.elastic import change_line, elastic_mesh
from composerun.config.schema import Config, LaunchConfig
from composerun.errors import LOG_FILE_ONLY, PREEMPTED_EXIT_CODE, ConfigError, Interrupted, Preempted
from composerun.launch import signals
from composerun.rundir import RunDir

if TYPE_CHECKING:
    from composerun.checkpoint.start import Start

log = logging.getLogger("composerun")


def setup_rank_logging(run_dir: Path, rank: int, level: str = "INFO") -> None:
    """rank{R}.log for every rank; the console for rank 0 only (less LOG_FILE_ONLY records)."""
    # A log line that cannot be written (a full disk) is dropped, not reported with a traceback
    # on the console: the run's own error is the line the user needs.
    logging.raiseExceptions = False
    logger = logging.getLogger("composerun")
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    fh = logging.FileHandler(RunDir(run_dir).rank_log(rank))
    fh.setFormatter(logging.Formatter(f"[rank{rank}][%(asctime)s][%(levelname)s] %(message)s"))
    logger.addHandler(fh)
    if rank == 0:
        ch = logging.StreamHandler(sys.stdout)
        ch.setFormatter(logging.Formatter("%(message)s"))
        ch.addFilter(lambda record: not all(getattr(record, k, None) == v for k, v in LOG_FILE_ONLY.items()))
        logger.addHandler(ch)


def run_rank(cfg: Config, run_dir: Path, rank: int, start: Start, log_level: str = "INFO") -> dict[str, Any]:
    """This rank's run from `start` (where the launching process decided it starts), the same
    for every way a rank starts: rank{R}.log (and the console for rank 0), then train/run.py's
    `run`.  A failure is logged with its traceback in rank{R}.log only, written to the error
    file where an elastic agent gave the rank one (TORCHELASTIC_ERROR_FILE: the agent's one
    line is made from it), and raised: the caller turns it into its exit.  Not logged as failures: the user's mistake (ConfigError, one line
    from whoever reports it) and a stop (a preemption, an interrupt)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from composerun.train.run import run

    setup_rank_logging(run_dir, rank, log_level)
    entry = record(run) if "TORCHELASTIC_ERROR_FILE" in os.environ else run  # set for every rank an agent starts
    try:
        return entry(cfg, run_dir, start)
    except (ConfigError, Preempted, Interrupted, KeyboardInterrupt):
        raise
    except BaseException:
        _log_traceback(rank)
        raise


def rank_entry(
    cfg: Config, run_dir: str, start: Start, log_level: str = "INFO", launcher: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One self-launched rank, from `start` (the launcher's decision of what it loads).  Errors
    propagate to the elastic agent (and its error file).  `launcher`: the launching process's
    pid and whether it ignores SIGHUP (nohup)."""
    launcher = launcher or {}
    signals.rank_signals(bool(launcher.get("ignore_hup")))  # before anything else: see signals.py
    if launcher.get("pid"):
        take_lock = None
        if os.environ.get("RANK") == "0" and launcher.get("lock"):
            from composerun.launch.lock import RunLock

            def take_lock() -> None:
                RunLock(Path(run_dir)).acquire(f"{launcher['lock']} (its ranks, saving after the launcher died)")

        signals.watch_launcher(int(launcher["pid"]), _shutdown_timeout(cfg.launch), take_lock)
    if os.environ.get("OMP_NUM_THREADS"):
        # A rank forked from the fork server inherits the thread count its OpenMP runtime
        # read at import time there; set this rank's own explicitly.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from torch.distributed.elastic.multiprocessing.errors import record

    rank = int(os.environ.get("RANK", "0"))
    # (recorded: a refusal here reaches the launcher's one line through the agent's error file)
    cfg, start = record(this_world)(cfg, Path(run_dir), start, rank)
    try:
        return run_rank(cfg, Path(run_dir), rank, start, log_level)
    except Preempted:
        sys.exit(PREEMPTED_EXIT_CODE)  # the checkpoint is published; the parent says where


def this_world(cfg: Config, run_dir: Path, start: Start, rank: int) -> tuple[Config, Start]:
    """The config and start of ranks that torch's agents started in a world of their own: the
    mesh for it (elastic_world), and when they were started again, rank 0's pick of the newest
    checkpoint (checkpoint/start.py's `restarted`; the other ranks load rank 0's choice:
    train/run.py).  The first ranks of a launch keep the launcher's decision: rank 0 marks the
    rendezvous as started (a restart after a node joined keeps TORCHELASTIC_RESTART_COUNT, and
    its rank 0 may be on a node whose launcher decided before any checkpoint was saved)."""
    cfg = elastic_world(cfg, int(os.environ.get("WORLD_SIZE", "1")), rank)
    if rank != 0:
        return cfg, start
    marker = RunDir(run_dir).ranks_started(os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    if not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return cfg, start
    from composerun.checkpoint.start import restarted
    from composerun.launch.preflight import meta_model, model_shapes

    return cfg, restarted(cfg, run_dir, start, lambda: model_shapes(meta_model(cfg)))


def elastic_world(cfg: Config, world: int, rank: int) -> Config:
    """The config for the world this rank's agents formed: with mesh.elastic=true and a node
    range, fewer nodes than launch.nodes (SLURM gave fewer, or one was lost) run on the mesh
    and train.grad_accum of config/elastic.py's rule, as torchrun's ranks do (job.py)."""
    shape = list(cfg.mesh.shape)
    if not cfg.mesh.elastic or world == math.prod(shape):
        return cfg
    t = cfg.train
    got = elastic_mesh(shape, cfg.mesh.dim_names, cfg.mesh.elastic_dim, t.grad_accum, cfg.data.batch_size, world)
    if rank == 0:
        print(change_line(shape, got, world, t.grad_accum, cfg.data.batch_size), flush=True)
    return replace(cfg, mesh=replace(cfg.mesh, shape=list(got.shape)), train=replace(t, grad_accum=got.grad_accum))


def _log_traceback(rank: int) -> None:
    """The console gets one line; the traceback goes to this rank's log file only."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "rank %d failed", (rank,), sys.exc_info())
    log.handlers[0].handle(record)


def _shutdown_timeout(lcfg: LaunchConfig) -> float:
    """The seconds ranks get to checkpoint and exit once asked to stop (as torch's agent reads it)."""
    given = lcfg.shutdown_timeout
    return float(given if given is not None else os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
