"""`composerun` / `python -m composerun`: Hydra composes once, then `task()` launches.

Hydra is told to re-raise (HYDRA_FULL_ERROR) so that composerun, not Hydra, reports a
user's mistake: one line naming the key and the fix, exit code 2, no traceback.

Under torchrun every rank runs this entry point (and so Hydra).  A small shim runs
first: the ranks agree on one run directory through torchrun's own store, and only rank
0 writes `.hydra/` (PITFALLS §1.1, §1.5).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from composerun import config as schema
from composerun import preempt
from composerun.errors import (
    CONFIG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    ConfigError,
    Interrupted,
    Preempted,
    Unrunnable,
)
from composerun.files import write_json
from composerun.launch import (
    RunFailed,
    check_environment,
    launch,
    prestart_fork_server,
    torchrun_store,
    under_torchrun,
)
from composerun.preflight import check_policy, check_run, has_checkpoints, meta_model, read_summary
from composerun.rundir import RunLock, discard_if_fresh, is_fresh, move_aside
from composerun.slurm import first_task

log = logging.getLogger("composerun")
schema.register()

# A single run's error, kept here so that Hydra does not print its own report of it.
_run_error: BaseException | None = None
# The command as typed, for the run-directory lock's record (sys.argv is rewritten for Hydra).
_command = "composerun"


def _model_options() -> list[str]:
    """Every model option on the search path, user config dirs included."""
    from hydra.core.global_hydra import GlobalHydra

    try:
        names = GlobalHydra.instance().config_loader().get_group_options("model")
    except Exception:  # Hydra not initialised: what composerun ships
        return schema.shipped_options("model")
    return sorted(n for n in names if not n.startswith("_"))  # _schema is the group's schema, not a model


def _write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """`.hydra/`: the resolved config, Hydra's own config and the overrides typed.  Hydra is
    told not to write them at job start (`hydra.output_subdir: null`): a command that fails
    its checks must leave an existing run directory as it was, so they are written here,
    once the run really starts."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    hc = HydraConfig.get()
    for name, text in (
        ("config.yaml", OmegaConf.to_yaml(cfg, resolve=True)),
        ("hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc}))),
        ("overrides.yaml", OmegaConf.to_yaml(hc.overrides.task)),
    ):
        tmp = hydra_dir / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(hydra_dir / name)


def task(cfg: DictConfig) -> dict[str, Any]:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    # Who writes the run directory's files before any rank starts: rank 0 under torchrun;
    # else the first task of a SLURM job of several nodes (or the only process there is).
    lead = rank == 0 if under_torchrun() else first_task()
    # Hydra made the run directory before this: empty, it is this command's (Hydra writes nothing
    # into it at job start), and a command that fails may remove it; otherwise it is never removed.
    created = run_dir.is_dir() and not any(run_dir.iterdir())
    t0 = time.perf_counter()
    started = False
    try:
        schema.validate(cfg, _model_options())
        payload = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        if cfg.plan:
            return _plan(cfg, payload, run_dir, lead)
        if under_torchrun():  # before any rank records an error file or writes anything
            from composerun.mesh import check_world_size

            check_world_size(list(cfg.mesh.shape), int(os.environ["WORLD_SIZE"]))
        world = schema.world_size(cfg)
        if not under_torchrun():  # the ranks' imports run while the run is checked here
            prestart_fork_server(payload["launch"], world)
        try:
            pre = check_run(payload, run_dir, world, self_launched=not under_torchrun(), lead=lead)
        except Unrunnable as e:
            if not _in_sweep():
                raise
            return _skip(run_dir, payload, str(e))  # a combination this sweep cannot run
        if pre.finished is not None:  # nothing to train, export or verify: the run's own results
            return _already_done(pre.finished, run_dir, lead)
        lock = RunLock(run_dir) if lead else None
        if lock is not None:
            lock.acquire(_command)
        try:
            started = True
            _note_written()
            moved = None
            if lead:
                moved = move_aside(run_dir, pre.replace)
                if moved is not None:
                    print(f"composerun: checkpoint.start_over: the earlier run's files are in {moved}", flush=True)
                _write_hydra_files(run_dir, cfg)
            if pre.resume_arg is not None:  # what the checks decided: the run's own newest checkpoint
                payload["checkpoint"]["resume"] = pre.resume_arg
            elif pre.resume is not None and moved is not None:  # going back: the checkpoint, where it was moved
                # (rank 0 finds the checkpoint for every rank: only its payload's path is read)
                payload["checkpoint"]["resume"] = str(_after_move(pre.resume, run_dir, moved))
            if under_torchrun():
                from torch.distributed.elastic.multiprocessing.errors import record

                from composerun.launch import setup_rank_logging
                from composerun.train import run

                setup_rank_logging(run_dir, rank)
                return record(run)(payload, run_dir)
            return launch(payload, run_dir, world, _command if lock is not None else None)
        finally:
            if lead and not under_torchrun():  # whatever the run came to: trained, preempted, failed
                _record_job_wall(run_dir, time.perf_counter() - t0)
            if lock is not None:
                lock.release()
    except ConfigError as e:
        if lead and not started:
            if _in_sweep():
                _fail_job(run_dir, cfg, str(e), created)
            elif created:
                discard_if_fresh(run_dir)
        raise
    except (Interrupted, KeyboardInterrupt) as e:  # a plan stopped by a signal, or Ctrl-C in this process
        if lead and created and getattr(e, "run_dir", None) is None:  # not ranks stopped: nothing of theirs to keep
            discard_if_fresh(run_dir)
        raise


def _after_move(resume: Path, run_dir: Path, moved: Path) -> Path:
    """Where a checkpoint of this run directory is once start_over moved its checkpoints aside."""
    root = (run_dir / "checkpoints").resolve()
    inside = resume.resolve() if resume.resolve().is_relative_to(root) else None
    return resume if inside is None else moved / "checkpoints" / inside.relative_to(root)


def _already_done(summary: dict[str, Any], run_dir: Path, lead: bool) -> dict[str, Any]:
    """A finished run run again: its checkpoint is at train.steps, and nothing else was asked
    for.  Its results are reported as they are; nothing in the run directory changes."""
    if lead:
        loss = summary.get("final_loss")
        med = summary.get("median_step_s")
        print(
            f"composerun: done: {summary.get('model')} on mesh {summary.get('mesh')} ({summary.get('policy')}) "
            f"already trained {summary.get('steps')} steps (nothing to do): final loss "
            f"{f'{loss:.4g}' if isinstance(loss, float) else 'n/a'}, "
            f"{f'{med * 1e3:.1f} ms/step' if isinstance(med, float) else 'n/a'}; run dir {run_dir}",
            flush=True,
        )
    return summary


def _fail_job(run_dir: Path, cfg: DictConfig, reason: str, created: bool) -> None:
    """A sweep's job that failed its checks: the sweep's report lists it with the reason.  A
    job directory this command made gets a summary.json saying so; an existing one (a sweep
    run again) is left as it was, and the report is told instead."""
    from composerun.report import SweepReport

    SweepReport.note_failure(run_dir, reason)
    if not created or not is_fresh(run_dir):
        return
    model = cfg.get("model") if not OmegaConf.is_missing(cfg, "model") else None
    summary = {
        "status": "failed",
        "reason": reason,
        "model": (model.get("name") or model.get("_target_")) if model is not None else None,
        "mesh": "x".join(map(str, cfg.mesh.shape)) if OmegaConf.select(cfg, "mesh.shape") is not None else None,
        "policy": OmegaConf.select(cfg, "sharding.name"),
        "run_dir": str(run_dir),
    }
    discard_if_fresh(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "summary.json", summary)
    _note_written()


def _plan(cfg: DictConfig, payload: dict[str, Any], run_dir: Path, lead: bool) -> dict[str, Any]:
    """plan=true: the plan table and plan.json of this config on its mesh, from torch's fake
    process group in this process; no rank starts, nothing trains."""
    from composerun.plan import format_table, write_plan
    from composerun.planner import plan_offline

    check_policy(payload, meta_model(payload))
    earlier = read_summary(run_dir)
    if lead and (has_checkpoints(run_dir) or (earlier and earlier.get("status") != "planned")):
        raise ConfigError(
            f"plan=true writes plan.json and summary.json, but hydra.run.dir={run_dir} holds a run: "
            "plan in a new directory (leave hydra.run.dir out)"
        )
    with preempt.raising(lambda signum: Interrupted(None, signum, "planning stopped; no plan written")):
        report, facts = plan_offline(payload)
    summary = {
        "status": "planned",
        "model": report["model"],
        "mesh": report["mesh"],
        "world_size": report["world_size"],
        "policy": report["policy"],
        **facts,
        "run_dir": str(run_dir),
    }
    if lead:  # under torchrun (or SLURM) every process plans the same; one says it
        lock = RunLock(run_dir)
        lock.acquire(_command)
        try:
            _note_written()
            _write_hydra_files(run_dir, cfg)
            write_plan(run_dir / "plan.json", report)
            write_json(run_dir / "summary.json", summary)
        finally:
            lock.release()
        print(format_table(report))
        print(
            f"composerun: plan: {report['world_size']} ranks from {facts['planned_ranks']} distinct shard layouts "
            f"in {facts['plan_s']:.1f} s; {run_dir / 'plan.json'}"
        )
    return summary


def _record_job_wall(run_dir: Path, seconds: float) -> None:
    """The job's wall time as the process that ran it saw it (config checked, ranks started,
    trained, stopped), beside the ranks' own figures: the sweep report sets a sweep's wall
    time against their sum."""
    path = run_dir / "summary.json"
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
            if summary.get("steps_this_run") == 0 and "job_wall_s" in summary:
                return  # nothing trained (an export, say): the job's time is the training's
            write_json(path, {**summary, "job_wall_s": seconds})
        except (OSError, json.JSONDecodeError):
            pass  # the summary is the ranks'; a failure to add a figure must not fail the run


def _note_written() -> None:
    """A job of a sweep wrote into its directory (see SweepReport.wrote)."""
    from composerun.report import SweepReport

    SweepReport.wrote = True


def _in_sweep() -> bool:
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _skip(run_dir: Path, payload: dict[str, Any], reason: str) -> dict[str, Any]:
    """Record a sweep cell that cannot run (HSDP on a 1-D mesh, ...) instead of failing it."""
    summary = {
        "status": "skipped",
        "reason": reason,
        "model": payload["model"].get("name") or payload["model"]["_target_"],
        "mesh": "x".join(map(str, payload["mesh"]["shape"])),
        "policy": payload["sharding"].get("name"),
        "run_dir": str(run_dir),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "summary.json", summary)
    _note_written()
    log.warning("composerun: skipped: %s", reason)
    return summary


@hydra.main(version_base="1.3", config_path="pkg://composerun.configs", config_name="train")
def _hydra_main(cfg: DictConfig) -> Any:
    global _run_error
    if _in_sweep():
        try:
            return task(cfg)
        except (Preempted, Interrupted) as e:  # a stopped job stops the sweep, to be run again
            e.rerun = f"hydra.sweep.dir={Path(HydraConfig.get().sweep.dir).resolve()}"
            raise
        except (ConfigError, RunFailed, CheckpointError) as e:
            # the sweep goes on to its next job; the first failure is the command's line at the end
            # (left to Hydra, it would print its own "Error executing job" line first)
            _run_error = _run_error or e
            return None
    try:
        return task(cfg)
    except (ConfigError, RunFailed, CheckpointError, Preempted, Interrupted) as e:
        _run_error = e


# --- one-line error reports ----------------------------------------------------------


def format_config_error(e: BaseException) -> str | None:
    """One line for a Hydra/OmegaConf composition error, or None if `e` is not one."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    inner: BaseException | None = e
    while inner is not None:  # composerun's own check inside an interpolation (a resolver)
        if isinstance(inner, ConfigError):
            return str(inner)
        inner = inner.__cause__ or inner.__context__  # OmegaConf re-raises without `from`
    if isinstance(e, MissingConfigException):
        text = str(e)
        m = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
        opts = [o for o in re.findall(r"^\t(\S+)$", text, re.M) if not o.startswith("_")]
        if m:
            group, name = m.groups()
            hint = " (or any shape spelt like them: mesh=3x2)" if group == "mesh" else ""
            return f"unknown {group} '{name}': choose one of {', '.join(opts)}{hint}"
        return " ".join(text.split())
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    past = re.search(r"dict is not a subclass of .*\n\s*full_key: ([\w.]+)\[(\d+)\]\n", str(cause))
    if past:  # `sharding.rules.7.every=1` on a policy of 2 rules: OmegaConf makes up an empty rule
        key, i = past.groups()
        return (
            f"{key}.{i}: there is no rule {i} to change (composerun --cfg job lists the policy's rules); "
            f"to add one, give the whole list: '{key}=[{{match: ..., api: ...}}, ...]'"
        )
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        msg = (getattr(cause, "msg", None) or str(cause)).splitlines()[0]
        # OmegaConf names a key inside a list element without its path (`api`, not
        # `sharding.rules[0].api`): prefix the override the user typed.
        typed = re.search(r"override '?([\w.\[\]]+)=?", str(e))
        where = ""
        if key and typed and not typed.group(1).startswith(key) and not key.startswith(typed.group(1)):
            where = typed.group(1)
        if isinstance(cause, ConfigKeyError) and key:
            inside = f" in {where}" if where else ""
            return f"unknown key '{key}'{inside}: check its spelling (composerun --cfg job lists every key)"
        if where:
            key = f"{where}: {key}"
        if key:
            return f"{key}: {msg}"
        return msg
    if isinstance(e, HydraException):
        return " ".join(str(e).split())
    return None


# `mesh=2` reaches Hydra as the int 2, which a config-group override rejects with a
# traceback ("must be a string"); quoting bare numbers keeps `mesh=2` and sweeps such
# as `mesh=1,2,2x2` working, and turns `mesh=2_4` (Hydra's int 24) into a clear error.
_MESH_ARG = re.compile(r"^(\+{0,2}mesh=)(.+)$")


def quote_mesh_choices(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        m = _MESH_ARG.match(a)
        if m and not m.group(2).startswith(("[", "choice(", "range(", "glob(", "'", '"')):
            items = m.group(2).split(",")
            a = m.group(1) + ",".join(f"'{v}'" if re.fullmatch(r"[\d_]+", v) else v for v in items)
        out.append(a)
    return out


def _mesh_values(argv: list[str]) -> list[str]:
    return [v for a in argv if (m := _MESH_ARG.match(a)) for v in m.group(2).split(",")]


def _torchrun_shim(argv: list[str]) -> list[str]:
    """Under torchrun: one run directory for all ranks, `.hydra/` from rank 0 only."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    extra = []
    given = any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv)
    # torchrun's agent keeps a store for its ranks: when it does not answer, the ranks would
    # wait for it for minutes (here, and in init_process_group)
    store = torchrun_store() if world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None
    if world > 1 and store is None and not given:  # each rank would take its own timestamped directory
        raise ConfigError(
            "torchrun without its agent store (TORCHELASTIC_USE_AGENT_STORE is not True): the ranks cannot agree "
            "on a run directory by themselves; give one with hydra.run.dir=DIR"
        )
    if not given and store is not None:
        # By default this is the store that torchrun's node-rank-0 agent created for this
        # launch, so the rendezvous id (`none` unless --rdzv-id is given on several nodes)
        # and the restart count tell runs apart; the ranks of every node read the same key.
        key = f"composerun/run_dir/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if rank == 0:
            store.set(key, datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S"))
        extra.append(f"hydra.run.dir={store.get(key).decode()}")
    if rank > 0:
        extra += ["hydra.output_subdir=null", f"hydra.job.name=rank{rank}"]
    return argv + extra


def _empty_output_dir(argv: list[str]) -> str | None:
    """`hydra.run.dir=` with no value: Hydra would write the run into the current directory."""
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if eq and key in ("hydra.run.dir", "hydra.sweep.dir") and not value.strip(" '\""):
            return f"{key} is empty: name a directory for the run, or leave it out (outputs/DATE/TIME)"
    return None


def main() -> None:
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composerun formats the errors itself
    empty = _empty_output_dir(sys.argv[1:])
    if empty:
        _fail(empty, CONFIG_EXIT_CODE)
    global _command
    _command = " ".join(["composerun", *map(shlex.quote, sys.argv[1:])])
    argv = quote_mesh_choices(sys.argv[1:])
    schema.register_mesh_shapes(_mesh_values(argv))
    # A log line that cannot be written (its run directory removed, a full disk) is dropped,
    # not reported with a traceback: the command's own line is what the user needs.
    logging.raiseExceptions = False
    # Hydra logs "Error executing job with overrides" for a failed job of a sweep; composerun
    # says what failed itself, in one line.
    logging.getLogger("hydra.core.utils").setLevel(logging.CRITICAL)
    try:
        check_environment()
        if under_torchrun():
            argv = _torchrun_shim(argv)
    except ConfigError as e:  # the rank is not known (or not to be trusted): every process says it
        _fail(str(e), CONFIG_EXIT_CODE, every_rank=True)
    sys.argv = [sys.argv[0], *argv]
    try:
        with preempt.recording():  # a signal while Hydra composes is acted on, not fatal
            _hydra_main()
        if _run_error is not None:
            raise _run_error
    except Preempted as e:  # a sweep stops here too: Preempted is no Exception to Hydra
        _fail(str(e), PREEMPTED_EXIT_CODE, "")
    except Interrupted as e:  # so does an interrupted one
        _fail(str(e), e.exit_code, "")
    except KeyboardInterrupt:  # Ctrl-C before any rank started (or in a run on this process)
        _fail("interrupted (SIGINT)", 128 + signal.SIGINT, "")
    except ConfigError as e:
        _fail(str(e) + (_sweep_not_started() or _report_failed_sweep()), CONFIG_EXIT_CODE)
    except (RunFailed, CheckpointError) as e:
        _fail(str(e) + _report_failed_sweep(), 1)
    except Exception as e:
        line = format_config_error(e)
        if line is None and 'Could not detect "srun"' in str(e):  # submitit's check for a SLURM cluster
            line = "hydra/launcher=slurm submits to SLURM, but srun is not on the PATH: run it on a SLURM login node"
        if line is None and isinstance(e, OSError):  # Hydra could not create the run (or sweep) directory
            where = e.filename or "the run directory"
            key = "hydra.sweep.dir" if _multirun(argv) else "hydra.run.dir"
            line = f"cannot write {where}: {e.strerror or e}; choose a writable {key}"
        if line is None:
            raise
        _fail(line + _sweep_not_started(), CONFIG_EXIT_CODE)


def _multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a.startswith("--multirun=") for a in argv)


def _sweep_not_started() -> str:
    """Hydra composes every job of a sweep before it starts one, after it created the sweep
    directory: when that failed, the directory holds only Hydra's multirun.yaml; remove it."""
    from composerun.report import SweepReport

    sweep = SweepReport.started
    if sweep is None or not sweep.is_dir() or any(p.name != "multirun.yaml" for p in sweep.iterdir()):
        return ""
    shutil.rmtree(sweep, ignore_errors=True)
    return " (no job of the sweep was started)"


def _report_failed_sweep() -> str:
    """A sweep whose job failed: Hydra ran every job, then raised the first failure without
    its end-of-sweep callback; the report of the jobs is written here instead."""
    from composerun.report import SweepReport

    if SweepReport.started is None or not SweepReport.started.is_dir():
        return ""
    report = SweepReport.finish() or SweepReport.report
    return f" (a job of the sweep; the sweep's report: {report})" if report else ""


def _fail(line: str, code: int, kind: str = "error: ", every_rank: bool = False) -> None:
    # Under torchrun every rank sees the same config error or preemption: rank 0 says it once.
    if every_rank or code == 1 or not under_torchrun() or os.environ.get("RANK", "0") == "0":
        print(f"composerun: {kind}{line}", file=sys.stderr)
    sys.exit(code)
