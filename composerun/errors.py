"""The two kinds of failure a user can meet, and how each one ends the process.

`ConfigError` is the user's mistake: one line that names the key or file and what to
do, exit code 2, no traceback.  `CheckpointError` wraps DCP's `CheckpointException`,
which derives from BaseException and would otherwise slip past `except Exception`
in Hydra's job runner and abort a whole sweep (PITFALLS §3.6).
"""

CONFIG_EXIT_CODE = 2


class ConfigError(ValueError):
    """A bad config value, file or combination; the message is shown as is."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or trusted."""
