"""`composerun` / `python -m composerun`: Hydra composes once, then `task()` launches.

Hydra is told to re-raise (HYDRA_FULL_ERROR) so that composerun, not Hydra, reports a
user's mistake: one line naming the key and the fix, exit code 2, no traceback.

Under torchrun every rank runs this entry point (and so Hydra).  A small shim runs
first: the ranks agree on one run directory through torchrun's own store, and only rank
0 writes `.hydra/` (left alone, each rank stamps its own timestamped directory, seconds
apart, and every rank writes `.hydra/` into it at once).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from composerun import stopping
from composerun.config import key_hint, register, register_mesh_shapes
from composerun.errors import (
    CONFIG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    ConfigError,
    Interrupted,
    Preempted,
    RunFailed,
)
from composerun.launch import job
from composerun.launch.torchrun import check_environment, torchrun_shim, under_torchrun
from composerun.report import JobNotes, SweepReport, sweep_reports

log = logging.getLogger("composerun")
register()


class Command:
    """One command line: the task Hydra runs for each of its jobs (one, or a sweep's), and what
    it keeps across them: the line as typed (for the run directory's lock) and the first error,
    raised once Hydra is done (so that Hydra does not print its own report of it)."""

    def __init__(self, line: str) -> None:
        self.line = line
        self.error: BaseException | None = None

    def __call__(self, cfg: DictConfig) -> Any:
        notes = JobNotes(Path(HydraConfig.get().runtime.output_dir))
        if not job.in_sweep():
            try:
                return job.task(cfg, self.line, notes)
            except (ConfigError, RunFailed, CheckpointError, Preempted, Interrupted) as e:
                self.error = e
                return None
        try:
            job.task(cfg, self.line, notes)
        except (Preempted, Interrupted) as e:  # a stopped job stops the sweep, to be run again
            e.rerun = f"hydra.sweep.dir={Path(HydraConfig.get().sweep.dir).resolve()}"
            raise
        except (ConfigError, RunFailed, CheckpointError) as e:
            # the sweep goes on to its next job; the first failure is the command's line at the end
            # (left to Hydra, it would print its own "Error executing job" line first)
            self.error = self.error or e
        return notes  # to the sweep's report (report.SweepReport.on_job_end)


# --- one-line error reports ----------------------------------------------------------


def format_config_error(e: BaseException) -> str | None:
    """One line for a Hydra/OmegaConf composition error, or None if `e` is not one."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

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
        missing = re.match(r"Key '([^']+)' not in '", msg)
        said = where or key
        if missing and isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and said.endswith(missing.group(1)):
            # a misspelt key (`train.step=5`): as the user typed it, with the nearest real key
            name = missing.group(1)
            prefix = said[: -len(name)]
            hint = key_hint(getattr(cause, "object_type", None), name, prefix)
            return f"{said}: no such key in {prefix.rstrip('.') or 'the config'}{hint}"
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


# `plan=true` is the shorthand of `plan.enabled=true` (plan.memory_gib, plan.device ... beside it).
_PLAN_ARG = re.compile(r"^(\+{0,2})plan=(.*)$")


def quote_mesh_choices(argv: list[str]) -> list[str]:
    """The command line as Hydra should read it: mesh values quoted (above), and `plan=V`
    as `plan.enabled=V`."""
    out = []
    for a in argv:
        m = _MESH_ARG.match(a)
        if m and not m.group(2).startswith(("[", "choice(", "range(", "glob(", "'", '"')):
            items = m.group(2).split(",")
            a = m.group(1) + ",".join(f"'{v}'" if re.fullmatch(r"[\d_]+", v) else v for v in items)
        p = _PLAN_ARG.match(a)
        if p and not p.group(2).startswith("{"):
            a = f"plan.enabled={p.group(2)}"
        out.append(a)
    return out


def _mesh_values(argv: list[str]) -> list[str]:
    return [v for a in argv if (m := _MESH_ARG.match(a)) for v in m.group(2).split(",")]


def _empty_output_dir(argv: list[str]) -> str | None:
    """`hydra.run.dir=` with no value: Hydra would write the run into the current directory."""
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if eq and key in ("hydra.run.dir", "hydra.sweep.dir") and not value.strip(" '\""):
            return f"{key} is empty: name a directory for the run, or leave it out (outputs/DATE/TIME)"
    return None


def main() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # composerun's own help, not Hydra's dump
        from composerun import usage

        print(usage.text())
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composerun formats the errors itself
    empty = _empty_output_dir(sys.argv[1:])
    if empty:
        _fail(empty, CONFIG_EXIT_CODE)
    command = Command(" ".join(["composerun", *map(shlex.quote, sys.argv[1:])]))
    argv = quote_mesh_choices(sys.argv[1:])
    register_mesh_shapes(_mesh_values(argv))
    # A log line that cannot be written (its run directory removed, a full disk) is dropped,
    # not reported with a traceback: the command's own line is what the user needs.
    logging.raiseExceptions = False
    # Hydra logs "Error executing job with overrides" for a failed job of a sweep; composerun
    # says what failed itself, in one line.
    logging.getLogger("hydra.core.utils").setLevel(logging.CRITICAL)
    try:
        check_environment()
        if under_torchrun():
            argv = torchrun_shim(argv)
    except ConfigError as e:  # the rank is not known (or not to be trusted): every process says it
        _fail(str(e), CONFIG_EXIT_CODE, every_rank=True)
    sys.argv = [sys.argv[0], *argv]
    # (Hydra names the job after the task's module: `cli`)
    hydra_main = hydra.main(version_base="1.3", config_path="pkg://composerun.configs", config_name="train")(command)
    sweeps: list[SweepReport] = []  # the report of the sweep Hydra starts, for the lines below
    try:
        with stopping.recording(), sweep_reports(sweeps):  # a signal while Hydra composes is acted on, not fatal
            hydra_main()
        if command.error is not None:
            raise command.error
    except Preempted as e:  # a sweep stops here too: Preempted is no Exception to Hydra
        _fail(str(e), PREEMPTED_EXIT_CODE, "")
    except Interrupted as e:  # so does an interrupted one
        _fail(str(e), e.exit_code, "")
    except KeyboardInterrupt:  # Ctrl-C before any rank started (or in a run on this process)
        _fail("interrupted (SIGINT)", 128 + signal.SIGINT, "")
    except ConfigError as e:
        _fail(str(e) + (_sweep_not_started(sweeps) or _report_failed_sweep(sweeps)), CONFIG_EXIT_CODE)
    except (RunFailed, CheckpointError) as e:
        _fail(str(e) + _report_failed_sweep(sweeps), 1)
    except BrokenPipeError:  # `composerun --help | head`: the entry point ends it quietly
        raise
    except Exception as e:
        line = _unquoted_space(e, argv) or format_config_error(e)
        if line is None and 'Could not detect "srun"' in str(e):  # submitit's check for a SLURM cluster
            line = "hydra/launcher=slurm submits to SLURM, but srun is not on the PATH: run it on a SLURM login node"
        if line is None and isinstance(e, OSError):  # Hydra could not create the run (or sweep) directory
            where = e.filename or "the run directory"
            key = "hydra.sweep.dir" if _multirun(argv) else "hydra.run.dir"
            line = f"cannot write {where}: {e.strerror or e}; choose a writable {key}"
        if line is None:
            raise
        _fail(line + _sweep_not_started(sweeps), CONFIG_EXIT_CODE)


def _unquoted_space(e: BaseException, argv: list[str]) -> str | None:
    """`hydra.run.dir=my run`, typed without quotes: the shell splits it, and Hydra reports
    `run` as an override it cannot parse (missing EQUAL).  Say what happened and how to quote it."""
    from hydra.errors import OverrideParseException

    if not isinstance(e, OverrideParseException) or e.override not in argv:
        return None
    i = argv.index(e.override)
    j = i
    while j > 0 and "=" not in argv[j - 1]:  # the words the shell split off, back to key=value
        j -= 1
    if j == 0 or "=" in e.override or argv[j - 1].startswith("-"):
        return None
    rest = [argv[j - 1]]
    k = j
    while k < len(argv) and "=" not in argv[k] and not argv[k].startswith("-"):
        rest.append(argv[k])
        k += 1
    key = argv[j - 1].split("=", 1)[0]
    return (
        f"'{e.override}' is not key=value: if it belongs to {key.lstrip('+~')}'s value, the shell split the value "
        f"at a space; quote it: {shlex.quote(' '.join(rest))}"
    )


def _multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a.startswith("--multirun=") for a in argv)


def _sweep_not_started(sweeps: list[SweepReport]) -> str:
    """Hydra composes every job of a sweep before it starts one, after it created the sweep
    directory: when that failed, the directory holds only Hydra's multirun.yaml; remove it."""
    sweep = sweeps[-1].started if sweeps else None
    if sweep is None or not sweep.is_dir() or any(p.name != "multirun.yaml" for p in sweep.iterdir()):
        return ""
    shutil.rmtree(sweep, ignore_errors=True)
    return " (no job of the sweep was started)"


def _report_failed_sweep(sweeps: list[SweepReport]) -> str:
    """A sweep whose job failed: Hydra ran every job, then raised the first failure without
    its end-of-sweep callback; the report of the jobs is written here instead."""
    sweep = sweeps[-1] if sweeps else None
    if sweep is None or sweep.started is None or not sweep.started.is_dir():
        return ""
    report = sweep.finish() or sweep.report
    return f" (a job of the sweep; the sweep's report: {report})" if report else ""


def _fail(line: str, code: int, kind: str = "error: ", every_rank: bool = False) -> None:
    # Under torchrun every rank sees the same config error or preemption: rank 0 says it once.
    if every_rank or code == 1 or not under_torchrun() or os.environ.get("RANK", "0") == "0":
        print(f"composerun: {kind}{line}", file=sys.stderr)
    sys.exit(code)
