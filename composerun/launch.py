"""Starting the ranks.

Outside torchrun, the parent (which ran Hydra once) starts world-size ranks through
torch's elastic launcher API, the engine torchrun itself uses: c10d rendezvous on a free
localhost port, no restarts.  Ranks get the resolved config as a plain dict and never
run Hydra.  One rank stays in this process.  When any rank fails, the agent stops the
others and the parent reports the first failure's rank and error on one line.

Inside a SLURM job of several nodes (hydra/launcher=slurm, launch.nodes=N), this runs on
every node and each node's agent starts its share of the ranks; the agents meet on the
job's first host (composerun/slurm.py).

Preemption (composerun/preempt.py): SIGTERM or SIGUSR1 to the parent reaches the agent,
which sends the same signal to every rank and waits `launch.shutdown_timeout` seconds
for them; the ranks checkpoint the step they are in and exit with PREEMPTED_EXIT_CODE,
and the parent reports where they stopped, from rank 0's summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from composerun import preempt
from composerun.errors import PREEMPTED_EXIT_CODE, ConfigError, Interrupted, Preempted
from composerun.files import write_json
from composerun.slurm import first_task, nodes_from_env

log = logging.getLogger("composerun")


class RunFailed(RuntimeError):
    """A rank failed; the message names the rank and its error."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and not os.environ.get("COMPOSERUN_SELF_LAUNCHED")


# Seconds a torchrun rank waits for torchrun's store: it is up before any rank starts, so a
# store that does not answer is a wrong address, not a slow start.
STORE_WAIT_S = 10


def check_environment(env: dict[str, str] | None = None) -> None:
    """The variables a launch reads, checked before anything reads them: ConfigError naming
    the variable.  Under torchrun (TORCHELASTIC_RUN_ID set), the rank variables it sets."""
    env = os.environ if env is None else env
    timeout = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if timeout is not None and not re.fullmatch(r"\s*\d+\s*", timeout):  # torch reads it with int()
        raise ConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={timeout!r}: must be a whole number of seconds (or unset: 30)"
        )
    if "TORCHELASTIC_RUN_ID" not in env or env.get("COMPOSERUN_SELF_LAUNCHED"):
        return
    why = "TORCHELASTIC_RUN_ID is set, so this process is taken for a rank torchrun started"
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        value = env.get(var)
        if value is None or not value.strip():
            raise ConfigError(f"{var} is not set ({why}): start it with torchrun, or unset TORCHELASTIC_RUN_ID")
        if var != "MASTER_ADDR" and not value.strip().isdigit():
            raise ConfigError(
                f"{var}={value!r} is not a number ({why}): start it with torchrun, or unset TORCHELASTIC_RUN_ID"
            )
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world < 1 or rank >= world:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world}: a rank is 0 to WORLD_SIZE-1 ({why})")


def torchrun_store() -> Any:
    """A client of the store torchrun's agent keeps for its ranks (TORCHELASTIC_USE_AGENT_STORE),
    or ConfigError within STORE_WAIT_S seconds naming the address that does not answer."""
    import socket

    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # A plain connection first: torch's client retries for half a minute past its timeout,
    # printing a C++ stack trace for each try.
    deadline, why = time.monotonic() + STORE_WAIT_S, ""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            break
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() > deadline:
            raise ConfigError(
                f"cannot reach torchrun's store at MASTER_ADDR:MASTER_PORT = {addr}:{port} within {STORE_WAIT_S} s "
                f"({why}): start the ranks with torchrun, or unset TORCHELASTIC_RUN_ID"
            )
        time.sleep(0.2)
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=120))


def setup_rank_logging(run_dir: Path, rank: int, level: str = "INFO") -> None:
    """rank{R}.log for every rank; the console for rank 0 only."""
    # A log line that cannot be written (a full disk) is dropped, not reported with a traceback
    # on the console: the run's own error is the line the user needs.
    logging.raiseExceptions = False
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


def rank_entry(
    cfg: dict[str, Any], run_dir: str, log_level: str = "INFO", launcher: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One self-launched rank.  Errors propagate to the elastic agent (and its error file).
    `launcher`: the launching process's pid and whether it ignores SIGHUP (nohup)."""
    launcher = launcher or {}
    preempt.rank_signals(bool(launcher.get("ignore_hup")))  # before anything else: see preempt.py
    if launcher.get("pid"):
        take_lock = None
        if os.environ.get("RANK") == "0" and launcher.get("lock"):
            from composerun.rundir import RunLock

            def take_lock() -> None:
                RunLock(Path(run_dir)).acquire(f"{launcher['lock']} (its ranks, saving after the launcher died)")

        preempt.watch_launcher(int(launcher["pid"]), _shutdown_timeout(cfg["launch"]), take_lock)

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
    except Preempted:
        sys.exit(PREEMPTED_EXIT_CODE)  # the checkpoint is published; the parent says where
    except ConfigError:
        raise  # the parent reports it as the user's mistake, in one line
    except BaseException:
        _log_traceback(rank)
        raise


def _log_traceback(rank: int) -> None:
    """The console gets one line; the traceback goes to this rank's log file only."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "rank %d failed", (rank,), sys.exc_info())
    log.handlers[0].handle(record)


def _read_summary(run_dir: Path, since: float = 0.0) -> dict[str, Any] | None:
    """summary.json, if there is a readable one written at `since` (a time.time()) or later."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None  # an earlier run's
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def plan_stamp(run_dir: Path) -> tuple[int, int] | None:
    """plan.json's identity now (rank 0 replaces it once a run's resume has succeeded)."""
    try:
        st = (run_dir / "plan.json").stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


_ANY = object()


def _failed(run_dir: Path | None, line: str, plan_before: Any = _ANY) -> RunFailed:
    """summary.json says the run failed and why (keeping what a finished run wrote, such as
    a verification report); with no run_dir, another node writes it.  A run that failed
    before it got going (its resume failed: rank 0 had not replaced plan.json since it was
    `plan_before`) leaves the run directory's summary as it was: the line says why."""
    if run_dir is None:
        return RunFailed(line)
    if plan_before is not _ANY and plan_stamp(run_dir) in (None, plan_before):
        return RunFailed(line)
    summary = _read_summary(run_dir) or {"run_dir": str(run_dir)}
    summary.update(status="failed", error=line)
    try:
        write_json(run_dir / "summary.json", summary)
    except OSError:
        pass  # a full disk, say: the line is what the user gets
    return RunFailed(line)


def _preempted(run_dir: Path, since: float, resume: str, signame: str | None) -> Preempted:
    """Where preempted ranks stopped, from the summary rank 0 wrote in this launch; none
    means they were stopped before they could checkpoint (still starting, or killed when
    the agent's shutdown_timeout ran out: a partial save is never resumed from)."""
    summary = _read_summary(run_dir, since) or {}
    if summary.get("status") != "preempted":
        return Preempted(run_dir, None, None, resume, signame)
    return Preempted(
        run_dir, summary["preempted_at_step"], summary["checkpoint"], resume, signame or summary.get("signal")
    )


def _shutdown_timeout(lcfg: dict[str, Any]) -> float:
    """The seconds ranks get to checkpoint and exit once asked to stop (as torch's agent reads it)."""
    given = lcfg.get("shutdown_timeout")
    return float(given if given is not None else os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))


def _omp_threads(lcfg: dict[str, Any], nproc: int) -> str:
    given = lcfg.get("omp_threads")
    return str(given or max(1, (os.cpu_count() or 1) // nproc))


def _report(rank: int, kind: str, text: str, run_dir: Path, writes: bool = True, plan_before: Any = _ANY) -> Exception:
    """The one line the user sees.  A config or checkpoint problem is stated as it is; any
    other failure names the rank and points at its traceback."""
    if kind == "ConfigError":
        return ConfigError(text)
    summary_dir = run_dir if writes else None
    if kind in ("CheckpointError", "VerifyError"):
        return _failed(summary_dir, text, plan_before)
    what = f"{kind}: {text}" if kind else text
    return _failed(summary_dir, f"rank {rank} failed: {what} (traceback in {run_dir / f'rank{rank}.log'})", plan_before)


# A rank whose peer died fails inside a collective with one of these; it is not the cause.
_PEER_GONE = re.compile(
    r"gloo/transport|Connection (closed|reset) by peer|remote process exited|NCCL communicator was aborted"
)


def _message(failure: Any) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    return str(msg or "").strip()


def _all_failures(err: Any) -> dict[int, Any]:
    """The failures the agent saw, and those of this node's other ranks that had written an
    error file when the agent stopped them: the agent reports the first rank it found dead,
    which may be one that lost the failed rank as a peer while that rank was still exiting."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    out = dict(err.failures)
    for rank, f in err.failures.items():
        path = Path(getattr(f, "error_file", "") or "")
        if not path.is_file() or not path.parent.name.isdigit():
            continue
        offset = rank - int(path.parent.name)  # global rank - local rank on this node
        for other in path.parent.parent.glob("*/error.json"):
            if other.parent.name.isdigit() and offset + int(other.parent.name) not in out:
                local = int(other.parent.name)
                try:
                    out[offset + local] = ProcessFailure(local_rank=local, pid=0, exitcode=1, error_file=str(other))
                except (ValueError, KeyError, TypeError, OSError):
                    # the agent stopped that rank while it was writing the file (open() had
                    # truncated it): it holds no complete report, so it cannot be the cause
                    continue
    return out


def _root_failure(err: Any) -> tuple[int, Any]:
    """The failure that caused the others.  torch's get_first_failure takes the earliest
    error-file timestamp, but those are whole seconds: a rank that raised and the rank that
    then lost it as a peer often tie, and the tie goes to the lower rank.  So a failure that
    is only a lost peer counts as later than any other."""
    failures = _all_failures(err)
    return min(failures.items(), key=lambda kv: (bool(_PEER_GONE.search(_message(kv[1]))), kv[1].timestamp, kv[0]))


def _failure_line(err: Any) -> tuple[int, str, str]:
    """(root failed rank, its exception's class name, the first line of its message)."""
    rank, failure = _root_failure(err)
    msg = _message(failure)
    if not msg or msg.startswith("To enable traceback"):
        msg = (
            f"exited with code {failure.exitcode}" if failure.exitcode >= 0 else f"killed by signal {-failure.exitcode}"
        )
    first = msg.splitlines()[0]
    kind, sep, text = first.partition(": ")
    if not sep or " " in kind:  # not "Class: message"
        return rank, "", first
    return rank, kind.rsplit(".", 1)[-1], text


def launch(cfg: dict[str, Any], run_dir: Path, world: int, lock_holder: str | None = None) -> dict[str, Any]:
    """Run on `world` ranks (this process, for one); `lock_holder`: the command holding the run
    directory's lock, which rank 0 takes over if this process dies."""
    from composerun.train import run

    if world == 1:
        nodes_from_env(cfg["launch"], world)  # a SLURM job of several nodes must not run one rank on each
        setup_rank_logging(run_dir, 0)
        plan_before = plan_stamp(run_dir)
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
            raise _report(0, type(e).__name__, first, run_dir, plan_before=plan_before) from None

    from composerun.train import worker

    # the ranks watch this process; rank 0 takes over the run directory's lock if it dies
    launcher = {"pid": os.getpid(), "ignore_hup": preempt.HUP_IGNORED, "lock": lock_holder}
    results = start_ranks(
        worker, (cfg, str(run_dir), "INFO", launcher), world, run_dir, cfg["launch"], cfg["checkpoint"]["resume"]
    )
    return results[min(results)]  # rank 0's summary; on a node without rank 0, its first rank's


# What a self-launched rank imports before its first step.  With start_method=forkserver they
# are imported once, in the fork server, which then forks every rank: spawned ranks would
# each import torch again, all at the same time, on the same cores.  torch._dynamo is
# imported by torch.use_deterministic_algorithms (some 200 modules: the largest part).
RANK_MODULES = [
    # first: the fork server ignores a process group's signals (Ctrl-C while it imports torch too)
    "composerun._forkserver",
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

    local = world // max(1, lcfg.get("nodes", 1))  # this node's ranks
    os.environ["OMP_NUM_THREADS"] = _omp_threads(lcfg, local)  # also the fork server's own imports
    multiprocessing.set_forkserver_preload(RANK_MODULES)
    with preempt.helpers_ignore_group_signals():
        forkserver.ensure_running()


def start_ranks(
    entry: Any, args: tuple, world: int, run_dir: Path, lcfg: dict[str, Any], resume: str = "auto"
) -> dict[int, Any]:
    """Run `entry(*args)` on `world` local ranks through torch's elastic agent; returns
    every rank's result, or raises ConfigError/RunFailed naming the first failed rank, or
    Preempted when a preemption signal stopped them (`resume`: checkpoint.resume, for the hint)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The elastic agent logs its every move, and a failed rank's traceback, on the console;
    # composerun reports one line instead and points at the rank's log (rank{R}.log).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # Its modules' get_logger() gives each logger a level of its own, which the parent's does
    # not override ("Received 15 death signal, shutting down workers" on a preemption).
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    # ... and a rank's error file it cannot parse (one the rank was stopped while writing, or
    # could not write on a full disk) with a traceback
    logging.getLogger("torch.distributed.elastic.multiprocessing.errors").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    rdzv = _rendezvous(lcfg, world)
    os.environ["OMP_NUM_THREADS"] = _omp_threads(lcfg, rdzv["nproc_per_node"])  # only torchrun sets it (PITFALLS §1.2)
    os.environ["COMPOSERUN_SELF_LAUNCHED"] = "1"
    prestart_fork_server(lcfg, world)
    with preempt.helpers_ignore_group_signals():  # (the fork server starts one too)
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    lc = LaunchConfig(
        **rdzv,
        rdzv_backend="c10d",
        max_restarts=0,
        monitor_interval=lcfg["monitor_interval"],
        start_method=lcfg["start_method"],
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "torchelastic")),
        # the agent forwards each of these to the ranks and waits for them (then SIGKILL)
        signals_to_handle=preempt.agent_signals(),
        shutdown_timeout=lcfg.get("shutdown_timeout"),  # None: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s
    )
    if preempt.requested():  # while Hydra composed the config: start nothing
        raise _preempted(run_dir, time.time(), resume, preempt.requested())
    since, plan_before = time.time(), plan_stamp(run_dir)
    try:
        with preempt.agent_handlers():
            return elastic_launch(lc, entry)(*args)
    except SignalException as e:
        if e.sigval not in preempt.SIGNALS:  # Ctrl-C and the like: stopped at once
            raise Interrupted(run_dir, int(e.sigval), resume=resume) from None
        done = _read_summary(run_dir, since)
        if done and done.get("status") == "ok":  # the ranks had finished: nothing was cut short
            return {0: done}
        raise _preempted(run_dir, since, resume, signal.Signals(e.sigval).name) from None
    except ChildFailedError as e:
        if _root_failure(e)[1].exitcode == PREEMPTED_EXIT_CODE:  # a rank got the signal itself
            raise _preempted(run_dir, since, resume, None) from None
        raise _report(*_failure_line(e), run_dir, writes=first_task(), plan_before=plan_before) from None
    except (ValueError, OSError) as e:  # the agent could not read a failed rank's error file
        raise _failed(run_dir if first_task() else None, _unreadable_report(run_dir, e), plan_before) from None
    finally:
        os.environ.pop("COMPOSERUN_SELF_LAUNCHED", None)


def _unreadable_report(run_dir: Path, e: BaseException) -> str:
    """The line for a rank that failed without a readable error file (it could not write one)."""
    import shutil

    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    if free is not None and free < 1 << 20:
        return (
            f"the disk of {run_dir} is full ({free} bytes free): a rank failed writing to it; free some space "
            "and run the same command again (the newest complete checkpoint is resumed)"
        )
    why = " ".join(str(e).split())[:200]
    return (
        f"a rank failed, and its error report could not be read ({type(e).__name__}: {why}); "
        f"its log (rank<R>.log in {run_dir}) says more"
    )


def _rendezvous(lcfg: dict[str, Any], world: int) -> dict[str, Any]:
    """Where the agents meet.  One node: a free localhost port, a fresh id.  Several nodes
    of a SLURM job: the job's first host, the job id, world / nodes ranks per node."""
    nodes = nodes_from_env(lcfg, world)
    if nodes is None:
        return dict(
            min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=uuid.uuid4().hex, rdzv_endpoint="localhost:0"
        )
    log.info(
        "%d nodes: %d ranks on this one, rendezvous at %s, id %s",
        nodes.count,
        nodes.nproc_per_node,
        nodes.rdzv_endpoint,
        nodes.run_id,
    )
    return dict(
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        nproc_per_node=nodes.nproc_per_node,
        run_id=nodes.run_id,
        rdzv_endpoint=nodes.rdzv_endpoint,
    )
