"""Starting the ranks.

Outside torchrun, the parent (which ran Hydra once) starts world-size ranks through
torch's elastic launcher API, the engine torchrun itself uses: c10d rendezvous on a free
localhost port, no restarts.  Ranks get the resolved config as a plain dict and never
run Hydra.  One rank stays in this process.  When any rank fails, the agent stops the
others and the parent reports the first failure's rank and error on one line.

Inside a SLURM job of several nodes (hydra/launcher=slurm, launch.nodes=N), this runs on
every node and each node's agent starts its share of the ranks; the agents meet on the
job's first host (slurm.py).

Preemption (signals.py, composerun/stopping.py): SIGTERM or SIGUSR1 to the parent reaches the agent,
which sends the same signal to every rank and waits `launch.shutdown_timeout` seconds
for them; the ranks checkpoint the step they are in and exit with PREEMPTED_EXIT_CODE,
and the parent reports where they stopped, from rank 0's summary.json.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from composerun import stopping
from composerun.checkpoint.folders import find_latest
from composerun.checkpoint.start import Start
from composerun.config.schema import Config, LaunchConfig, StartMethod
from composerun.errors import PREEMPTED_EXIT_CODE, ConfigError, Interrupted, Preempted, RunFailed
from composerun.launch import signals
from composerun.launch.rank import rank_entry, run_rank
from composerun.launch.slurm import first_task, nodes_from_env
from composerun.rundir import RunDir

log = logging.getLogger("composerun")


def plan_stamp(run_dir: Path) -> tuple[int, int] | None:
    """plan.json's identity now (rank 0 replaces it once a run's resume has succeeded)."""
    try:
        st = RunDir(run_dir).plan.stat()
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
    summary = RunDir(run_dir).read_summary() or {"run_dir": str(run_dir)}
    summary.update(status="failed", error=line)
    try:
        RunDir(run_dir).write_summary(summary)
    except OSError:
        pass  # a full disk, say: the line is what the user gets
    return RunFailed(line)


def _preempted(run_dir: Path, since: float, resume: str, signame: str | None) -> Preempted:
    """Where preempted ranks stopped, from the summary rank 0 wrote in this launch; none
    means they were stopped before they could checkpoint (still starting, or killed when
    the agent's shutdown_timeout ran out: a partial save is never resumed from)."""
    summary = RunDir(run_dir).read_summary(since) or {}
    if summary.get("status") != "preempted":
        return Preempted(run_dir, None, None, resume, signame, find_latest(RunDir(run_dir).checkpoints))
    newest = None if summary["checkpoint"] else find_latest(RunDir(run_dir).checkpoints)
    return Preempted(
        run_dir, summary["preempted_at_step"], summary["checkpoint"], resume, signame or summary.get("signal"), newest
    )


def _omp_threads(lcfg: LaunchConfig, nproc: int) -> str:
    return str(lcfg.omp_threads or max(1, (os.cpu_count() or 1) // nproc))


def _report(rank: int, kind: str, text: str, run_dir: Path, writes: bool = True, plan_before: Any = _ANY) -> Exception:
    """The one line the user sees.  A config or checkpoint problem is stated as it is; any
    other failure names the rank and points at its traceback."""
    if kind == "ConfigError":
        return ConfigError(text)
    summary_dir = run_dir if writes else None
    if kind in ("CheckpointError", "VerifyError"):
        return _failed(summary_dir, text, plan_before)
    what = f"{kind}: {text}" if kind else text
    log_file = RunDir(run_dir).rank_log(rank)
    return _failed(summary_dir, f"rank {rank} failed: {what} (traceback in {log_file})", plan_before)


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


def launch(cfg: Config, run_dir: Path, world: int, start: Start, lock_holder: str | None = None) -> dict[str, Any]:
    """Run on `world` ranks (this process, for one), from `start` (checkpoint/start.py: what
    they load); `lock_holder`: the command holding the run directory's lock, which rank 0
    takes over if this process dies."""
    if world == 1:  # the rank in this process, its config as it is; its failure is reported here
        nodes_from_env(cfg.launch, world)  # a SLURM job of several nodes must not run one rank on each
        plan_before = plan_stamp(run_dir)
        try:
            return run_rank(cfg, run_dir, 0, start)
        except ConfigError:
            raise
        except Exception as e:
            import torch.distributed as dist

            if dist.is_initialized():  # the only rank: nobody else is inside a collective
                dist.destroy_process_group()
            first = (str(e).strip().splitlines() or [""])[0]
            raise _report(0, type(e).__name__, first, run_dir, plan_before=plan_before) from None

    # the ranks watch this process; rank 0 takes over the run directory's lock if it dies
    launcher = {"pid": os.getpid(), "ignore_hup": signals.HUP_IGNORED, "lock": lock_holder}
    results = start_ranks(
        rank_entry, (cfg, str(run_dir), start, "INFO", launcher), world, run_dir, cfg.launch, start.resume
    )
    return results[min(results)]  # rank 0's summary; on a node without rank 0, its first rank's


# What a self-launched rank imports before its first step.  With start_method=forkserver they
# are imported once, in the fork server, which then forks every rank: spawned ranks would
# each import torch again, all at the same time, on the same cores.  torch._dynamo is
# imported by torch.use_deterministic_algorithms (some 200 modules: the largest part).
RANK_MODULES = [
    # first: the fork server ignores a process group's signals (Ctrl-C while it imports torch too)
    "composerun.launch.forkserver",
    "torch",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing.api",
    "composerun.train.run",
    "composerun.launch.rank",
    "composerun.data.sources",
    "composerun.models.reference",
    "composerun.cli",  # multiprocessing re-runs the parent's main script (the console script) in each rank
]


# What a rank of `+model=hf` imports besides: transformers and its model code (some seconds of
# CPU each time), once in the fork server rather than in every rank.
HF_RANK_MODULES = ["transformers", "transformers.modeling_utils", "composerun.models.hf_causal"]


def prestart_fork_server(lcfg: LaunchConfig, world: int, model_target: str | None = None) -> None:
    """With launch.start_method=forkserver: start the fork server (a fresh interpreter, so no
    threads of this process are inherited by a rank) and let it import RANK_MODULES (and
    HF_RANK_MODULES for a Hugging Face model, `model_target`) while this process is still
    checking the config.  Does nothing if it already runs (a sweep)."""
    if world <= 1 or lcfg.start_method != StartMethod.forkserver:
        return
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    local = world // max(1, lcfg.nodes)  # this node's ranks
    os.environ["OMP_NUM_THREADS"] = _omp_threads(lcfg, local)  # also the fork server's own imports
    hf = HF_RANK_MODULES if (model_target or "").startswith("composerun.models.hf_causal.") else []
    multiprocessing.set_forkserver_preload([*RANK_MODULES, *hf])
    # The fork server's start first starts the resource tracker where none runs, and that
    # start ends by unblocking SIGINT and SIGTERM (not by putting the mask back): the fork
    # server's interpreter then started with them let through, and a Ctrl-C while it imported
    # printed a traceback.  So the tracker is started first, on its own.
    with signals.helpers_ignore_group_signals():
        resource_tracker.ensure_running()
    with signals.helpers_ignore_group_signals():
        forkserver.ensure_running()


def _threaded(entry: Any, *args: Any) -> Any:
    """A rank: its thread count from OMP_NUM_THREADS (set above for this launch), then `entry`.
    A rank forked from a fork server otherwise keeps the count the server's OpenMP runtime read
    when it started, that of the launch that started it (after a 1-rank launch, every later rank
    of 2 or 4 on 2 cores took every core, and spent most of its CPU in OpenMP's spinning waits)."""
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return entry(*args)


def start_ranks(
    entry: Any, args: tuple, world: int, run_dir: Path, lcfg: LaunchConfig, resume: str = "auto"
) -> dict[int, Any]:
    """Run `entry(*args)` on `world` local ranks through torch's elastic agent; returns
    every rank's result, or raises ConfigError/RunFailed naming the first failed rank, or
    Preempted when a preemption signal stopped them (`resume`: checkpoint.resume, for the hint)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher

    from composerun import _torch_compat as compat

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
    compat.quiet_rendezvous_names()
    rdzv = _rendezvous(lcfg, world)
    # torchrun sets OMP_NUM_THREADS; torch's launcher API does not, and N ranks would each take every core
    os.environ["OMP_NUM_THREADS"] = _omp_threads(lcfg, rdzv["nproc_per_node"])
    os.environ["COMPOSERUN_SELF_LAUNCHED"] = "1"
    prestart_fork_server(lcfg, world)
    with signals.helpers_ignore_group_signals():  # (the fork server starts one too)
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    if rdzv["max_restarts"]:
        # torch's agents would keep one store for the ranks across restarts, and a restarted
        # rank could read an address of the attempt that died (pytorch#135712)
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    lc = compat.elastic_launch_config(
        **rdzv,
        rdzv_backend="c10d",
        monitor_interval=lcfg.monitor_interval,
        start_method=lcfg.start_method.value,
        logs_specs=DefaultLogsSpecs(log_dir=str(RunDir(run_dir).agent_logs)),
        # the agent forwards each of these to the ranks and waits for them (then SIGKILL)
        signals_to_handle=signals.agent_signals(),
        shutdown_timeout=lcfg.shutdown_timeout,  # None: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s
    )
    if stopping.requested():  # while Hydra composed the config: start nothing
        raise _preempted(run_dir, time.time(), resume, stopping.requested())
    since, plan_before = time.time(), plan_stamp(run_dir)
    try:
        with signals.agent_handlers():
            return launcher.elastic_launch(lc, _threaded)(entry, *args)
    except SignalException as e:
        if e.sigval not in stopping.SIGNALS:  # Ctrl-C and the like: stopped at once
            newest = find_latest(RunDir(run_dir).checkpoints)
            raise Interrupted(run_dir, int(e.sigval), resume=resume, newest=newest) from None
        done = RunDir(run_dir).read_summary(since)
        if done and done.get("status") == "ok":  # the ranks had finished: nothing was cut short
            return {0: done}
        raise _preempted(run_dir, since, resume, signal.Signals(e.sigval).name) from None
    except ChildFailedError as e:
        if _root_failure(e)[1].exitcode == PREEMPTED_EXIT_CODE:  # a rank got the signal itself
            raise _preempted(run_dir, since, resume, None) from None
        rank, kind, text = _failure_line(e)
        if not kind:  # killed, or exited with no error of its own: how NCCL's watchdog ends a rank that hung
            text += _flight_recorder_dumps(run_dir, since)
        raise _report(rank, kind, text, run_dir, writes=first_task(), plan_before=plan_before) from None
    except (ValueError, OSError) as e:  # the agent could not read a failed rank's error file
        raise _failed(run_dir if first_task() else None, _unreadable_report(run_dir, e), plan_before) from None
    finally:
        os.environ.pop("COMPOSERUN_SELF_LAUNCHED", None)


def _flight_recorder_dumps(run_dir: Path, since: float) -> str:
    """`; a collective timed out: ...` where ranks wrote flight-recorder dumps in this launch."""
    from composerun.train.flight_recorder import dumps_since

    dumps = dumps_since(run_dir, since)
    if not dumps:
        return ""
    folder = dumps[0].parent
    return (
        f"; a collective timed out: the flight recorder's dumps are in {folder} ({', '.join(p.name for p in dumps)}; "
        f"python -m torch.distributed.flight_recorder.fr_trace {folder} reads them)"
    )


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


# Restarts of a node range's agents when launch.max_restarts is not given: a node lost, and
# one that joins later, each restart the ranks once (a join does not count: torch's agents).
RANGE_RESTARTS = 3


def _rendezvous(lcfg: LaunchConfig, world: int) -> dict[str, Any]:
    """Where the agents meet, and how often they restart the ranks.  One node: a free
    localhost port, a fresh id.  Several nodes of a SLURM job: the job's first host, the job
    id, world / nodes ranks per node, and with a node range (launch.min_nodes) any count in
    it, restarting the ranks on the nodes left when one is lost."""
    nodes = nodes_from_env(lcfg, world)
    if nodes is None:
        return dict(
            min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=uuid.uuid4().hex, rdzv_endpoint="localhost:0",
            max_restarts=lcfg.max_restarts or 0, rdzv_configs=dict(lcfg.rdzv_conf),
        )  # fmt: skip
    ranged = nodes.min_count < nodes.count
    log.info(
        "%s nodes: %d ranks on this one, rendezvous at %s, id %s",
        f"{nodes.min_count}-{nodes.count}" if ranged else nodes.count,
        nodes.nproc_per_node,
        nodes.rdzv_endpoint,
        nodes.run_id,
    )
    restarts = lcfg.max_restarts if lcfg.max_restarts is not None else RANGE_RESTARTS * ranged
    return dict(
        min_nodes=nodes.min_count,
        max_nodes=nodes.count,
        nproc_per_node=nodes.nproc_per_node,
        run_id=nodes.run_id,
        rdzv_endpoint=nodes.rdzv_endpoint,
        max_restarts=restarts,
        # the job's first task hosts the rendezvous' store (torch would guess it from host names)
        rdzv_configs={**lcfg.rdzv_conf, "is_host": first_task()},
    )
