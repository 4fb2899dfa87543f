"""Starting the ranks.

Outside torchrun, the parent (which ran Hydra once) starts world-size ranks through
torch's elastic launcher API, the engine torchrun itself uses: c10d rendezvous on a free
localhost port, no restarts.  Ranks get the resolved config as a plain dict and never
run Hydra.  One rank stays in this process.  When any rank fails, the agent stops the
others and the parent reports the first failure's rank and error on one line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from composerun.errors import ConfigError
from composerun.files import write_json

log = logging.getLogger("composerun")


class RunFailed(RuntimeError):
    """A rank failed; the message names the rank and its error."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and not os.environ.get("COMPOSERUN_SELF_LAUNCHED")


def setup_rank_logging(run_dir: Path, rank: int, level: str = "INFO") -> None:
    """rank{R}.log for every rank; the console for rank 0 only."""
    logger = logging.getLogger("composerun")
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    fh = logging.FileHandler(run_dir / f"rank{rank}.log")
    fh.setFormatter(logging.Formatter(f"[rank{rank}][%(asctime)s][%(levelname)s] %(message)s"))
    logger.addHandler(fh)
    if rank == 0:
        ch = logging.StreamHandler(sys.stdout)
        ch.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(ch)


def rank_entry(cfg: dict[str, Any], run_dir: str, log_level: str = "INFO") -> dict[str, Any]:
    """One self-launched rank.  Errors propagate to the elastic agent (and its error file)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from composerun.train import run

    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("OMP_NUM_THREADS"):
        # A rank forked from the fork server inherits the thread count its OpenMP runtime
        # read at import time there; set this rank's own explicitly.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    setup_rank_logging(Path(run_dir), rank, log_level)
    try:
        return record(run)(cfg, run_dir)
    except ConfigError:
        raise  # the parent reports it as the user's mistake, in one line
    except BaseException:
        _log_traceback(rank)
        raise


def _log_traceback(rank: int) -> None:
    """The console gets one line; the traceback goes to this rank's log file only."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "rank %d failed", (rank,), sys.exc_info())
    log.handlers[0].handle(record)


def _failed(run_dir: Path, line: str) -> RunFailed:
    """summary.json says the run failed and why (keeping what a finished run wrote, such as
    a verification report)."""
    path = run_dir / "summary.json"
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    summary.update(status="failed", error=line)
    write_json(path, summary)
    return RunFailed(line)


def _omp_threads(lcfg: dict[str, Any], nproc: int) -> str:
    given = lcfg.get("omp_threads")
    return str(given or max(1, (os.cpu_count() or 1) // nproc))


def _report(rank: int, kind: str, text: str, run_dir: Path) -> Exception:
    """The one line the user sees.  A config or checkpoint problem is stated as it is; any
    other failure names the rank and points at its traceback."""
    if kind == "ConfigError":
        return ConfigError(text)
    if kind in ("CheckpointError", "VerifyError"):
        return _failed(run_dir, text)
    what = f"{kind}: {text}" if kind else text
    return _failed(run_dir, f"rank {rank} failed: {what} (traceback in {run_dir / f'rank{rank}.log'})")


def _failure_line(err: Any) -> tuple[int, str, str]:
    """(first failed rank, its exception's class name, the first line of its message)."""
    rank, failure = err.get_first_failure()
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    msg = str(msg or "").strip()
    if not msg or msg.startswith("To enable traceback"):
        msg = (
            f"exited with code {failure.exitcode}" if failure.exitcode >= 0 else f"killed by signal {-failure.exitcode}"
        )
    first = msg.splitlines()[0]
    kind, sep, text = first.partition(": ")
    if not sep or " " in kind:  # not "Class: message"
        return rank, "", first
    return rank, kind.rsplit(".", 1)[-1], text


def launch(cfg: dict[str, Any], run_dir: Path, world: int) -> dict[str, Any]:
    from composerun.train import run

    if world == 1:
        setup_rank_logging(run_dir, 0)
        try:
            return run(cfg, run_dir)
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception as e:
            _log_traceback(0)
            import torch.distributed as dist

            if dist.is_initialized():  # the only rank: nobody else is inside a collective
                dist.destroy_process_group()
            first = (str(e).strip().splitlines() or [""])[0]
            raise _report(0, type(e).__name__, first, run_dir) from None

    from composerun.train import worker

    return start_ranks(worker, (cfg, str(run_dir)), world, run_dir, cfg["launch"])[0]


# What a self-launched rank imports before its first step.  With start_method=forkserver they
# are imported once, in the fork server, which then forks every rank: spawned ranks would
# each import torch again, all at the same time, on the same cores.  torch._dynamo is
# imported by torch.use_deterministic_algorithms (some 200 modules: the largest part).
RANK_MODULES = [
    "torch",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing.api",
    "composerun.train",
    "composerun.launch",
    "composerun.data",
    "composerun.models.reference",
    "composerun.cli",  # multiprocessing re-runs the parent's main script (the console script) in each rank
]


def prestart_fork_server(lcfg: dict[str, Any], world: int) -> None:
    """With launch.start_method=forkserver: start the fork server (a fresh interpreter, so no
    threads of this process are inherited by a rank) and let it import RANK_MODULES while
    this process is still checking the config.  Does nothing if it already runs (a sweep)."""
    if world <= 1 or str(lcfg["start_method"]) != "forkserver":
        return
    import multiprocessing
    from multiprocessing import forkserver

    os.environ["OMP_NUM_THREADS"] = _omp_threads(lcfg, world)  # also the fork server's own imports
    multiprocessing.set_forkserver_preload(RANK_MODULES)
    forkserver.ensure_running()


def start_ranks(entry: Any, args: tuple, world: int, run_dir: Path, lcfg: dict[str, Any]) -> dict[int, Any]:
    """Run `entry(*args)` on `world` local ranks through torch's elastic agent; returns
    every rank's result, or raises ConfigError/RunFailed naming the first failed rank."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The elastic agent logs its every move, and a failed rank's traceback, on the console;
    # composerun reports one line instead and points at the rank's log (rank{R}.log).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    os.environ["OMP_NUM_THREADS"] = _omp_threads(lcfg, world)  # only the torchrun CLI sets it (PITFALLS §1.2)
    os.environ["COMPOSERUN_SELF_LAUNCHED"] = "1"
    prestart_fork_server(lcfg, world)
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=lcfg["monitor_interval"],
        start_method=lcfg["start_method"],
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "torchelastic")),
    )
    try:
        return elastic_launch(lc, entry)(*args)
    except ChildFailedError as e:
        raise _report(*_failure_line(e), run_dir) from None
    finally:
        os.environ.pop("COMPOSERUN_SELF_LAUNCHED", None)
