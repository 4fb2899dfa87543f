"""The kinds of failure a user can meet, and how each one ends the process.

`ConfigError` is the user's mistake: one line that names the key or file and what to
do, exit code 2, no traceback.  `CheckpointError` wraps DCP's `CheckpointException`,
which derives from BaseException and would otherwise slip past `except Exception`
in Hydra's job runner and abort a whole sweep.  `Preempted` is no
failure: the run was asked to stop (SIGTERM/SIGUSR1), saved, and can be started again.
`Interrupted` is Ctrl-C (or SIGHUP, SIGQUIT): the ranks are stopped at once, with no
checkpoint of their own, and the process exits with 128 + the signal's number.
"""

from __future__ import annotations

import signal
from pathlib import Path

CONFIG_EXIT_CODE = 2
# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": a preempted
# run stopped after a checkpoint, and the same command resumes it.
PREEMPTED_EXIT_CODE = 75
# A log record's `extra` for the rank's log file only, not rank 0's console: the line of a
# stop the command itself prints on stderr (Preempted's), which would otherwise show twice.
LOG_FILE_ONLY = {"composerun_file_only": True}


class ConfigError(ValueError):
    """A bad config value, file or combination; the message is shown as is."""


class Unrunnable(ConfigError):
    """A policy that cannot run on the mesh or the model (HSDP on a 1-D mesh, a rule that
    matches nothing): a config error, and in a sweep a combination recorded as skipped."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or trusted."""


class OutOfMemory(RuntimeError):
    """A rank ran out of memory; the message is the one line with the peak, the estimate, the
    memory snapshot and what to try (train/profile.py)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than launch.collective_timeout for its group's ranks; the
    message is the one line with the collective and the flight recorder's dump
    (train/flight_recorder.py)."""


class RunFailed(RuntimeError):
    """A rank failed; the message names the rank and its error."""


class Preempted(BaseException):
    """The run stopped on request at a step boundary; str() is the line to show.

    A BaseException, like KeyboardInterrupt: a stop request, not an error, so that
    `except Exception` (Hydra's job runner, torchelastic's @record) lets it through, a
    sweep stops instead of going on to its next job, and no error file is written.
    `newest`: the newest complete checkpoint there is, where this stop saved none.
    """

    def __init__(
        self,
        run_dir,
        step: int | None,
        checkpoint: str | None,
        resume: str,
        signame: str | None,
        newest: Path | None = None,
    ) -> None:
        super().__init__(run_dir, step, checkpoint, resume, signame, newest)
        self.run_dir, self.step, self.checkpoint, self.resume, self.signame = run_dir, step, checkpoint, resume, signame
        self.newest = newest
        self.rerun = f"hydra.run.dir={run_dir}"  # what starts this run again; a sweep names its sweep dir

    def __str__(self) -> str:
        by = f" ({self.signame})" if self.signame else ""
        where = f"at step {self.step}" if self.step is not None else "before a checkpoint could be written"
        resume_from = self.checkpoint or self.newest
        again = _again(self.run_dir, self.resume, self.rerun, resume_from is not None)
        if resume_from is None:
            return f"preempted{by} {where}: no checkpoint; {again} to start again"
        if self.checkpoint:
            return f"preempted{by} {where}: checkpoint saved to {self.checkpoint}; {again} to resume"
        return f"preempted{by} {where}: no new checkpoint; {again} to resume from {resume_from}"


class Interrupted(BaseException):
    """SIGINT, SIGHUP or SIGQUIT stopped the ranks at once (not at a step boundary, no
    checkpoint written for it); str() is the line to show.  A BaseException, like
    KeyboardInterrupt, for the same reasons as `Preempted`.  `newest`: the newest complete
    checkpoint the same command resumes from."""

    def __init__(
        self,
        run_dir,
        signum: int,
        what: str = "the ranks were stopped",
        resume: str = "auto",
        newest: Path | None = None,
    ) -> None:
        super().__init__(run_dir, signum, what, resume, newest)
        self.run_dir, self.signum, self.what, self.resume, self.newest = run_dir, signum, what, resume, newest
        self.exit_code = 128 + signum  # the shell's convention for a death by signal
        self.rerun = f"hydra.run.dir={run_dir}"  # what starts this run again; a sweep names its sweep dir

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.run_dir is None:
            return f"interrupted ({name}): {self.what}"
        if self.newest is None:
            return f"interrupted ({name}): {self.what}; no checkpoint in {self.run_dir}"
        return f"interrupted ({name}): {self.what}; {_again(self.run_dir, self.resume, self.rerun, True)} to resume from {self.newest}"


def _again(run_dir: Path, resume: str, rerun: str | None, resuming: bool) -> str:
    """What starts the run again (`rerun`: hydra.run.dir=RUN_DIR unless given); to resume,
    with checkpoint.resume=auto where the same command would not pick up its newest checkpoint."""
    again = f"run the same command with {rerun or f'hydra.run.dir={run_dir}'}"
    return again + (" checkpoint.resume=auto" if resuming and resume != "auto" else "")
