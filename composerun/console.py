"""What every console script shares: a reader that closes the pipe early is no error.

`composerun-ckpt inspect RUN | head` closes the pipe after ten lines; Python then raises
BrokenPipeError at the next write, or at exit when it flushes what is left.  The reader has
what it asked for, so the command ends quietly, with the status it would have had, and
never with a traceback or exit 1 (which composerun-ckpt documents as a damaged checkpoint).
"""

from __future__ import annotations

import functools
import os
import select
import sys
from collections.abc import Callable
from typing import Any


def quiet_on_closed_pipe(main: Callable[..., Any]) -> Callable[..., Any]:
    """`main` as a console script's entry point: a closed stdout or stderr ends it quietly."""

    @functools.wraps(main)
    def entry(*args: Any, **kwargs: Any) -> Any:
        try:
            result = main(*args, **kwargs)
        except SystemExit:  # its own status, whatever became of the output
            _flush()
            raise
        except BrokenPipeError:
            if not _mute_if_closed():  # a pipe of its own (to a rank, say) broke: a real error
                raise
            sys.exit(0)
        _flush()  # what print() left in the buffer meets the closed pipe here, not at exit
        return result

    return entry


def _flush() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _mute_if_closed()


def _mute_if_closed() -> bool:
    """Point stdout and stderr at /dev/null if either is a pipe whose reader is gone, so that
    nothing written later (logging, the interpreter's flush at exit) meets it again."""
    if not any(_reader_gone(s) for s in (sys.stdout, sys.stderr)):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream with no file of its own (a test's capture)
            pass
    return True


def _reader_gone(stream: Any) -> bool:
    """A pipe whose read end is closed reports an error to poll()."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False
