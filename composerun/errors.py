"""The kinds of failure a user can meet, and how each one ends the process.

`ConfigError` is the user's mistake: one line that names the key or file and what to
do, exit code 2, no traceback.  `CheckpointError` wraps DCP's `CheckpointException`,
which derives from BaseException and would otherwise slip past `except Exception`
in Hydra's job runner and abort a whole sweep (PITFALLS §3.6).  `Preempted` is no
failure: the run was asked to stop (SIGTERM/SIGUSR1), saved, and can be started again.
`Interrupted` is Ctrl-C (or SIGHUP, SIGQUIT): the ranks are stopped at once, with no
checkpoint of their own, and the process exits with 128 + the signal's number.
"""

CONFIG_EXIT_CODE = 2
# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": a preempted
# run stopped after a checkpoint, and the same command resumes it.
PREEMPTED_EXIT_CODE = 75


class ConfigError(ValueError):
    """A bad config value, file or combination; the message is shown as is."""


class Unrunnable(ConfigError):
    """A policy that cannot run on the mesh or the model (HSDP on a 1-D mesh, a rule that
    matches nothing): a config error, and in a sweep a combination recorded as skipped."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or trusted."""


class Preempted(BaseException):
    """The run stopped on request at a step boundary; str() is the line to show.

    A BaseException, like KeyboardInterrupt: a stop request, not an error, so that
    `except Exception` (Hydra's job runner, torchelastic's @record) lets it through, a
    sweep stops instead of going on to its next job, and no error file is written.
    """

    def __init__(self, run_dir, step: int | None, checkpoint: str | None, resume: str, signame: str | None) -> None:
        super().__init__(run_dir, step, checkpoint, resume, signame)
        self.run_dir, self.step, self.checkpoint, self.resume, self.signame = run_dir, step, checkpoint, resume, signame
        self.rerun = f"hydra.run.dir={run_dir}"  # what starts this run again; a sweep names its sweep dir

    def __str__(self) -> str:
        from composerun.preempt import stopped_line

        return stopped_line(self.run_dir, self.step, self.checkpoint, self.resume, self.signame, self.rerun)


class Interrupted(BaseException):
    """SIGINT, SIGHUP or SIGQUIT stopped the ranks at once (not at a step boundary, no
    checkpoint written for it); str() is the line to show.  A BaseException, like
    KeyboardInterrupt, for the same reasons as `Preempted`."""

    def __init__(self, run_dir, signum: int, what: str = "the ranks were stopped", resume: str = "auto") -> None:
        super().__init__(run_dir, signum, what, resume)
        self.run_dir, self.signum, self.what, self.resume = run_dir, signum, what, resume
        self.exit_code = 128 + signum  # the shell's convention for a death by signal
        self.rerun = f"hydra.run.dir={run_dir}"  # what starts this run again; a sweep names its sweep dir

    def __str__(self) -> str:
        import signal

        from composerun.preempt import interrupted_line

        name = signal.Signals(self.signum).name
        if self.run_dir is None:
            return f"interrupted ({name}): {self.what}"
        return interrupted_line(self.run_dir, name, self.what, self.resume, self.rerun)
