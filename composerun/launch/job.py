"""One job of the command line: a run, or one job of a sweep.  It checks the config and
everything it can know from the files before any rank starts (preflight.py), takes the run
directory (its lock), decides there where the run starts (checkpoint/start.py: the checkpoint
to load; start_over moves an earlier run aside), writes `.hydra/`, and starts the ranks
(agent.py) or, under torchrun, runs this rank, handing them that decision.  `plan=true`
plans instead."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from composerun import stopping
from composerun.config import shipped_options, to_typed, validate, world_size
from composerun.config.elastic import change_line, elastic_mesh
from composerun.config.schema import Config
from composerun.errors import CheckpointError, ConfigError, Interrupted, RunFailed, Unrunnable
from composerun.launch import signals
from composerun.launch.lock import RunLock
from composerun.launch.rank import run_rank
from composerun.launch.slurm import first_task
from composerun.launch.timing import command_started, done_line
from composerun.launch.torchrun import AGREED_RUN_DIR, under_torchrun
from composerun.models.hf import apply_pretrained
from composerun.report import JobNotes
from composerun.rundir import RunDir

# agent.py and preflight.py import torch (most of a short command's time): they are imported where a job
# first needs them, after the config's own checks, so that a command whose config is wrong, and
# `--help`, answer without it.

if TYPE_CHECKING:
    from composerun.checkpoint.start import Start

log = logging.getLogger("composerun")


def _model_options() -> list[str]:
    """Every model option on the search path, user config dirs included."""
    from hydra.core.global_hydra import GlobalHydra

    try:
        names = GlobalHydra.instance().config_loader().get_group_options("model")
    except Exception:  # Hydra not initialised: what composerun ships
        return shipped_options("model")
    return sorted(n for n in names if not n.startswith("_"))  # _schema is the group's schema, not a model


def _write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """`.hydra/`: the resolved config, Hydra's own config and the overrides typed.  Hydra is
    told not to write them at job start (`hydra.output_subdir: null`): a command that fails
    its checks must leave an existing run directory as it was, so they are written here,
    once the run really starts."""
    run = RunDir(run_dir)
    run.hydra.mkdir(parents=True, exist_ok=True)
    hc = HydraConfig.get()
    texts = (
        OmegaConf.to_yaml(cfg, resolve=True),
        OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})),
        OmegaConf.to_yaml(hc.overrides.task),
    )
    for path, text in zip(run.hydra_files, texts, strict=True):
        tmp = path.with_name(f"{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _checked(cfg: DictConfig) -> Config:
    """The config checked, as the ranks receive it (the schema's dataclasses), and torch
    imported: a Ctrl-C during torch's import is acted on when it is done (signals.py)."""
    with signals.interrupt_deferred():  # model.pretrained=DIR: its config.json's dimensions (transformers, torch)
        apply_pretrained(cfg)
    validate(cfg, _model_options())
    _elastic(cfg)
    config = to_typed(cfg)
    with signals.interrupt_deferred():
        import torch  # noqa: F401
    return config


def _elastic(cfg: DictConfig) -> None:
    """mesh.elastic=true under torchrun: the mesh and train.grad_accum for the world torch's
    agents formed (config/elastic.py), decided here, once, before any rank reads the config;
    the ranks, the checkpoint's manifest and the run's records see the mesh the run really has."""
    if not cfg.mesh.elastic or not under_torchrun():
        return  # self-launched: each rank takes the world its agents formed (rank.py)
    if os.environ.get(AGREED_RUN_DIR):
        raise ConfigError(
            "mesh.elastic=true under torchrun needs hydra.run.dir=DIR: at a restart the ranks would agree on "
            "a new timestamped run directory and start over instead of resuming this one"
        )
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch's agents keep one store across restarts, without a prefix that all nodes agree
        # on: a restarted rank can read an address of the attempt that died (pytorch#135712)
        raise ConfigError(
            "mesh.elastic=true under torchrun with --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
            "torchrun's environment: the ranks of a restart would otherwise read the dead attempt's addresses"
        )
    shape, world = list(cfg.mesh.shape), int(os.environ["WORLD_SIZE"])
    if world == math.prod(shape):
        return
    t = cfg.train
    got = elastic_mesh(shape, cfg.mesh.dim_names, cfg.mesh.elastic_dim, t.grad_accum, cfg.data.batch_size, world)
    if int(os.environ.get("RANK", "0")) == 0:
        print(change_line(shape, got, world, t.grad_accum, cfg.data.batch_size), flush=True)
    cfg.mesh.shape, t.grad_accum = list(got.shape), got.grad_accum


def task(cfg: DictConfig, command: str, notes: JobNotes) -> dict[str, Any]:
    """The job of `cfg`; `command`: the command line as typed (for the run directory's lock);
    `notes`: what a job of a sweep tells the sweep's report, filled in here."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    # who writes the run directory before any rank starts: rank 0 under torchrun, else a SLURM job's first task
    lead = rank == 0 if under_torchrun() else first_task()
    # Hydra made the run directory before this: empty, it is this command's (Hydra writes nothing
    # into it at job start), and a command that fails may remove it; otherwise it is never removed.
    created = run_dir.is_dir() and not any(run_dir.iterdir())
    t0, checked, started = time.perf_counter(), time.time(), False
    try:
        config = _checked(cfg)
        if config.plan.enabled:
            try:
                return _plan(cfg, config, run_dir, lead, command, notes)
            except Unrunnable as e:
                if not in_sweep():
                    raise
                return _skip(run_dir, config, str(e), notes)  # a layout this sweep cannot plan
        from composerun.checkpoint.start import choose
        from composerun.launch import agent, preflight  # (they import torch: see above)
        from composerun.parallel.mesh import check_world_size

        if under_torchrun():  # before any rank records an error file or writes anything
            check_world_size(config.mesh.shape, int(os.environ["WORLD_SIZE"]))
        world = world_size(cfg)
        if not under_torchrun():  # the ranks' imports run while the run is checked here
            agent.prestart_fork_server(config.launch, world, config.model._target_)
        try:
            want = preflight.check_run(config, world, self_launched=not under_torchrun())
        except Unrunnable as e:
            if not in_sweep():
                raise
            return _skip(run_dir, config, str(e), notes)  # a combination this sweep cannot run
        lock = RunLock(run_dir) if lead else None
        if lock is not None:
            lock.acquire(command)
        records = None
        try:
            # Where the run starts, decided once (checkpoint/start.py): the ranks load what it names.
            start = choose(config, run_dir, want, lead)
            if start.finished is not None:  # nothing to train, export or verify: the run's own results
                return _already_done(start.finished, run_dir, lead)
            started = notes.wrote = True
            moved = None
            if lead:
                moved = RunDir(run_dir).move_aside(list(start.replace))
                if moved is not None:
                    print(f"composerun: checkpoint.start_over: the earlier run's files are in {moved}", flush=True)
                records = RunDir(run_dir).keep_records()  # put back if the ranks fail before they load
                _write_hydra_files(run_dir, cfg)
            if start.load is not None and moved is not None:  # going back: the checkpoint, where it was moved
                load = _after_move(start.load, run_dir, moved)
                start = replace(start, load=load, resume=str(load))
            plan_before = agent.plan_stamp(run_dir)
            try:
                return _start_ranks(config, start, run_dir, world, rank, command if lock is not None else None, checked)
            except (ConfigError, RunFailed, CheckpointError):
                if records is not None and agent.plan_stamp(run_dir) == plan_before:  # the ranks never got going
                    records.put_back()
                    records = None  # (nor is the job's wall time added to the earlier run's summary)
                raise
        finally:
            if records is not None and not under_torchrun():  # whatever the run came to: trained, preempted, failed
                _record_job_wall(run_dir, time.perf_counter() - t0)
            if lock is not None:
                lock.release(started)
    except ConfigError as e:
        if lead and not started:
            if in_sweep():
                _fail_job(run_dir, cfg, str(e), created, notes)
            elif created:
                RunDir(run_dir).discard_if_fresh()
        raise
    except (MemoryError, RuntimeError) as e:  # this process's checks (a data source's __init__, ...)
        if started or not _out_of_memory(e):  # (a rank's own failure is the rank's report)
            raise
        if lead and created:
            RunDir(run_dir).discard_if_fresh()
        raise RunFailed(
            f"out of memory before any rank started ({type(e).__name__}: {_first_line(e)}): "
            "something the config builds in the launching process is too large for this machine"
        ) from None
    except (Interrupted, KeyboardInterrupt) as e:  # a plan stopped by a signal, or Ctrl-C in this process
        if lead and created and getattr(e, "run_dir", None) is None:  # not ranks stopped: nothing of theirs to keep
            RunDir(run_dir).discard_if_fresh()
        raise


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed (torch's allocators raise RuntimeError), not another error."""
    if isinstance(e, (RunFailed, CheckpointError)):
        return False
    return isinstance(e, MemoryError) or bool(re.search(r"can't allocate memory|not enough memory|out of memory", str(e)))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return re.sub(r"^\[enforce fail at [^\]]*\] err == 0\. ", "", text)  # torch's allocator's prefix


def _start_ranks(
    config: Config, start: Start, run_dir: Path, world: int, rank: int, lock_holder: str | None, checked: float
) -> dict[str, Any]:
    """Start the ranks (agent.py) or, under torchrun, run this one, from `start`; then the done
    line, with the time the user waited (`checked`: when the checks began), not only the
    ranks' (their own line is in rank0.log)."""
    from composerun.launch.agent import launch

    launched = time.time()
    if under_torchrun():  # this process is the rank: the config is the one it composed itself
        summary = run_rank(config, run_dir, rank, start)
    else:
        summary = launch(config, run_dir, world, start, lock_holder)
    if (rank == 0) if under_torchrun() else first_task():  # the lead (task's), once
        print(done_line(summary, command_started(under_torchrun()), checked, launched, world), flush=True)
    return summary


def _after_move(resume: Path, run_dir: Path, moved: Path) -> Path:
    """Where a checkpoint of this run directory is once start_over moved its checkpoints aside."""
    root = RunDir(run_dir).checkpoints.resolve()
    inside = resume.resolve() if resume.resolve().is_relative_to(root) else None
    return resume if inside is None else RunDir(moved).checkpoints / inside.relative_to(root)


def _already_done(summary: dict[str, Any], run_dir: Path, lead: bool) -> dict[str, Any]:
    """A finished run run again: its checkpoint is at train.steps, and nothing else was asked
    for.  Its results are reported as they are; nothing in the run directory changes."""
    if lead:
        loss, exported = summary.get("final_loss"), summary.get("export")
        med = summary.get("median_step_s")
        print(
            f"composerun: done: {summary.get('model')} on mesh {summary.get('mesh')} ({summary.get('policy')}) "
            f"already trained {summary.get('steps')} steps (nothing to do): final loss "
            f"{f'{loss:.4g}' if isinstance(loss, float) else 'n/a'}, "
            f"{f'{med * 1e3:.1f} ms/step' if isinstance(med, float) else 'n/a'}; "
            f"{f'exported to {exported}; ' if exported else ''}run dir {run_dir}",
            flush=True,
        )
    return summary


def _fail_job(run_dir: Path, cfg: DictConfig, reason: str, created: bool, notes: JobNotes) -> None:
    """A sweep's job that failed its checks: the sweep's report lists it with the reason.  A
    job directory this command made gets a summary.json saying so; an existing one (a sweep
    run again) is left as it was, and the report is told instead."""
    notes.failure = reason
    if not created or not RunDir(run_dir).is_fresh():
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
    RunDir(run_dir).discard_if_fresh()
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).write_summary(summary)
    notes.wrote = True


def _plan(cfg: DictConfig, config: Config, run_dir: Path, lead: bool, command: str, notes: JobNotes) -> dict[str, Any]:
    """plan=true: the plan table and plan.json of this config on its mesh, from torch's fake
    process group in this process; no rank starts, nothing trains."""
    from composerun.checkpoint.start import has_checkpoints
    from composerun.launch.preflight import check_policy, meta_model
    from composerun.parallel.estimate_report import estimate_lines, estimate_summary
    from composerun.parallel.plan import format_table, write_plan
    from composerun.parallel.planner import plan_offline

    check_policy(config, meta_model(config))
    run = RunDir(run_dir)
    earlier = run.read_summary()
    if lead and (has_checkpoints(run_dir) or (earlier and earlier.get("status") != "planned")):
        raise ConfigError(
            f"plan=true writes plan.json and summary.json, but hydra.run.dir={run_dir} holds a run: "
            "plan in a new directory (leave hydra.run.dir out)"
        )
    with stopping.raising(lambda signum: Interrupted(None, signum, "planning stopped; no plan written")):
        report, facts = plan_offline(config)
    summary = {
        "status": "planned",
        "model": report["model"],
        "mesh": report["mesh"],
        "world_size": report["world_size"],
        "policy": report["policy"],
        **facts,
        **estimate_summary(report),
        "run_dir": str(run_dir),
    }
    if lead:  # under torchrun (or SLURM) every process plans the same; one says it
        lock = RunLock(run_dir)
        lock.acquire(command)
        try:
            notes.wrote = True
            _write_hydra_files(run_dir, cfg)
            write_plan(run.plan, report)
            run.write_summary(summary)
        finally:
            lock.release()
        print(format_table(report))
        for line in estimate_lines(report):
            print(line)
        took = facts["plan_s"] + facts.get("estimate_s", 0.0)
        world, layouts = report["world_size"], facts["planned_ranks"]
        print(
            f"composerun: plan: {world} rank{'s' * (world != 1)} from {layouts} distinct shard "
            f"layout{'s' * (layouts != 1)} in {took:.1f} s; {run.plan}"
        )
    return summary


def _record_job_wall(run_dir: Path, seconds: float) -> None:
    """The job's wall time as the process that ran it saw it (config checked, ranks started,
    trained, stopped), beside the ranks' own figures: the sweep report sets a sweep's wall
    time against their sum."""
    run = RunDir(run_dir)
    summary = run.read_summary()
    if summary is None or (summary.get("steps_this_run") == 0 and "job_wall_s" in summary):
        return  # none, or nothing trained (an export, say): the job's time is the training's
    try:
        run.write_summary({**summary, "job_wall_s": seconds})
    except OSError:
        pass  # the summary is the ranks'; a failure to add a figure must not fail the run


def in_sweep() -> bool:
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _skip(run_dir: Path, config: Config, reason: str, notes: JobNotes) -> dict[str, Any]:
    """Record a sweep cell that cannot run (HSDP on a 1-D mesh, ...) instead of failing it."""
    summary = {
        "status": "skipped",
        "reason": reason,
        "model": config.model.name or config.model._target_,
        "mesh": "x".join(map(str, config.mesh.shape)),
        "policy": config.sharding.name,
        "run_dir": str(run_dir),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).write_summary(summary)
    notes.wrote = True
    log.warning("composerun: skipped: %s", reason)
    return summary
