"""Where a run starts: which checkpoint its ranks load (or none), decided once, before any
rank starts, by the process that holds the run directory's lock (the launcher; rank 0 under
torchrun).  The ranks are handed the answer, a `Start`, and load what it names; they never
look for a checkpoint themselves.

`choose` does, in this order:

1. recover: where the run goes on from its own checkpoints (checkpoint.resume=auto, or a
   `checkpoint.resume=PATH` run that has checkpoints of its own), a save every rank had
   written before the run stopped is published (recovery.py); any other leftover of an
   unfinished save is removed, once every check has passed;
2. pick: `auto` takes the run directory's newest complete checkpoint; `PATH` (a checkpoint, a
   run directory or its checkpoints/ folder) is where a run starts, and once the run directory
   has checkpoints of its own the same command resumes the newest of those, as a job submitted
   again must, and says so; `never` takes none;
3. the start-over rules: a run that would not continue the directory's own checkpoints
   (resume=never, an older checkpoint of its own, nothing to resume after a finished run) is
   refused unless checkpoint.start_over=true, which moves the earlier run's records aside;
4. check the checkpoint picked before any tensor is read (the manifest, every file's size,
   DCP's metadata and its checksum, the stored keys and shapes against the model's, its step
   against train.steps), print how the config given differs from its config, and tell a
   finished run run again (nothing to train, export or verify) from one to start.

Every refusal is a ConfigError of one line (exit 2).  Loading checks the data files'
checksums as it reads them (checkpointer.py): a file can still change after this.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from composerun.checkpoint.adapters import check_base
from composerun.checkpoint.folders import find_latest, read_latest, resolve_resume, step_folders
from composerun.checkpoint.recovery import recover, remove_leftovers
from composerun.config.schema import Config, Export
from composerun.config.typed import config_changes, to_plain
from composerun.errors import CheckpointError, ConfigError
from composerun.rundir import RunDir


@dataclass(frozen=True)
class Start:
    """Where a run starts, as `choose` decided it."""

    load: Path | None = None  # the checkpoint folder the ranks load; None: the initial weights
    step: int | None = None  # its step
    why: str = "no checkpoint to resume"  # how it was picked, in words
    # the checkpoint.resume with which the same command goes on from here (a stopped run's hint)
    resume: str = "auto"
    notes: tuple[str, ...] = ()  # what recovery did, for rank 0's log
    replace: tuple[str, ...] = ()  # an earlier run's records to move aside first (start_over)
    finished: dict[str, Any] | None = None  # a finished run's summary: nothing more to do


def has_checkpoints(run_dir: Path) -> bool:
    """Whether the run directory holds checkpoints (or what is left of them)."""
    root = RunDir(run_dir).checkpoints
    return bool(step_folders(root)) or read_latest(root) is not None


def choose(cfg: Config, run_dir: Path, want: dict[str, tuple[int, ...] | None], lead: bool = True) -> Start:
    """The decision of the module's docstring, for the model whose state-dict keys and shapes
    are `want`.  `lead`: the process that holds the run directory's lock, which recovers,
    removes leftovers and prints; any other (another node's, or a torchrun rank's) decides
    the same from the files without writing them, and its ranks load the lead's choice."""
    ck, steps = cfg.checkpoint, cfg.train.steps
    root = RunDir(run_dir).checkpoints
    if root.exists() and not root.is_dir():
        raise ConfigError(
            f"{root} is a file where the run's checkpoints go: move it away, or choose another hydra.run.dir"
        )
    earlier = RunDir(run_dir).read_summary()
    try:
        start, continues = _pick(cfg, run_dir, lead)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    holds = has_checkpoints(run_dir)
    # a run stopped before its first checkpoint (preempted, failed) may start again: nothing of it is kept
    if not continues and (holds or (earlier or {}).get("status") == "ok"):
        if not ck.start_over:
            raise ConfigError(_start_over_line(cfg, run_dir, holds, start.load))
        start = _with(start, replace=tuple(RunDir(run_dir).records()))
    if steps == 0 and start.load is None and not ck.init_from and not cfg.model.pretrained:
        raise ConfigError(
            "train.steps=0 trains nothing, and there is nothing to load (no checkpoint to resume, no "
            "checkpoint.init_from or model.pretrained): it would export or verify untrained weights; give the "
            "checkpoint to load"
        )
    if start.load is not None:
        manifest = check_checkpoint(start.load, want)
        check_base(cfg, manifest, start.load)  # an adapter-only checkpoint: trained on this run's base
        start = _with(start, step=manifest["step"])
        if steps and steps < start.step:
            raise ConfigError(
                f"train.steps={steps} is below step {start.step} of the checkpoint to resume ({start.load}): "
                f"set train.steps to {start.step} or more (0: load it without training), or start over "
                "with checkpoint.resume=never in a new hydra.run.dir"
            )
        if lead:
            _print_changes(cfg, manifest, start.load)
        nothing_else = (ck.export == Export.none or RunDir(run_dir).exported_already(earlier, ck.export)) and not ck.verify
        if continues and steps == start.step and nothing_else and earlier and earlier.get("status") == "ok":
            if Path(earlier.get("checkpoint") or "").name == start.load.name:  # (a run directory may have moved)
                return _with(start, finished=earlier)
    if lead and root.name not in start.replace:  # (moved aside, they are the earlier run's as they were)
        remove_leftovers(root)  # what unfinished saves, publishing and pruning left
    return start


def restarted(cfg: Config, run_dir: Path, start: Start, want: Any) -> Start:
    """Where ranks start that torch's agents started again (an elastic run that lost a node or
    got one back: the launcher, which decided `start` before the first ranks, is not asked
    again): the run directory's newest checkpoint once the run has saved one since, picked as
    `choose` picks it with checkpoint.resume=auto, else `start`.  For rank 0 (the others load
    its choice); `want()`: the model's state-dict keys and shapes, for the checks."""
    newest = find_latest(RunDir(run_dir).checkpoints)
    if newest is None or (start.load is not None and newest.resolve() == start.load.resolve()):
        return start  # (nothing saved since the launcher decided)
    auto = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto", start_over=False))
    return _with(choose(auto, run_dir, want(), lead=True), finished=None)  # (a finished run ends at once)


def _pick(cfg: Config, run_dir: Path, lead: bool) -> tuple[Start, bool]:
    """The checkpoint checkpoint.resume names, after the recovery of the run's own where the
    run goes on from them; and whether the run continues its directory's own checkpoints."""
    mode, root = cfg.checkpoint.resume, RunDir(run_dir).checkpoints
    if mode == "never":
        return Start(why="checkpoint.resume=never", resume=mode), False
    if mode == "auto":
        notes = tuple(recover(root)[1]) if lead else ()
        found = find_latest(root, strict=True)
        why = "the run directory's newest checkpoint" if found else "no checkpoint to resume"
        return Start(found, why=why, resume=mode, notes=notes), found is not None
    target = resolve_resume(Path(mode))
    own = find_latest(root, strict=True) if has_checkpoints(run_dir) else None
    if own is None or target.resolve().is_relative_to(root.resolve()):
        continues = own is not None and target.resolve() == own.resolve()
        return Start(target, why=f"checkpoint.resume={mode}", resume=mode), continues
    notes = tuple(recover(root)[1]) if lead else ()
    own = find_latest(root, strict=True) or own
    if lead:
        print(
            f"composerun: checkpoint.resume={mode} is where this run started; its run directory has "
            f"checkpoints of its own: resuming the newest, {own.name}",
            flush=True,
        )
    why = f"the run directory's newest checkpoint (checkpoint.resume={mode} is where the run started)"
    return Start(own, why=why, resume="auto", notes=notes), True


def _with(start: Start, **changes: Any) -> Start:
    return replace(start, **changes)


def _start_over_line(cfg: Config, run_dir: Path, holds: bool, resume: Path | None) -> str:
    ck = cfg.checkpoint
    what = "checkpoints of an earlier run" if holds else "a finished run (summary.json)"
    if resume is not None and holds:  # an older checkpoint of its own: going back
        why = f"checkpoint.resume={ck.resume} would go back to an older one and save over the later ones"
    else:
        why = {
            "never": "checkpoint.resume=never would start over on top of them",
            "auto": "there is no checkpoint to resume, so this run would start over on top of it",
        }.get(ck.resume, f"checkpoint.resume={ck.resume} would continue another checkpoint on top of them")
    return (
        f"hydra.run.dir={run_dir} holds {what} and {why}: resume them (checkpoint.resume=auto), choose a new "
        "hydra.run.dir, or add checkpoint.start_over=true to move the earlier run's files aside (nothing is deleted)"
    )


def check_checkpoint(path: Path, want: dict[str, tuple[int, ...] | None]) -> dict[str, Any]:
    """The checks a resume makes before reading any tensor (every file's size, DCP's metadata
    and its checksum, the manifest's fields, the stored keys and shapes); the manifest."""
    from composerun.checkpoint.checkpointer import untrusted
    from composerun.checkpoint.manifest import check_contents, check_readable

    try:
        manifest = check_readable(path)
    except CheckpointError as e:
        raise ConfigError(str(untrusted(e))) from None
    try:
        check_contents(path, want, manifest)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return manifest


def _print_changes(cfg: Config, manifest: dict[str, Any], path: Path) -> None:
    before = manifest.get("config")
    if not isinstance(before, dict):
        return  # a checkpoint of an older composerun: no config in its manifest
    changes = config_changes(before, to_plain(cfg))
    if changes:
        print(f"composerun: resuming {path} with a changed config: {'; '.join(map(str, changes))}", flush=True)
