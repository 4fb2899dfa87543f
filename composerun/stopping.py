"""Stop requests: SIGTERM or SIGUSR1 recorded, for the training loop to act on at the next
step boundary (with a checkpoint: a preemption), never from inside a signal handler, where
saving would interrupt a collective or a half-written file.  The loop reads the record once
per step and carries it in the step's existing all-reduce, so every rank agrees to stop
after the same step.  Who sets the handlers, and when, is the launcher's concern
(composerun/launch/signals.py)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[signal.Signals] = []


def _record(signum: int, frame: FrameType | None) -> None:
    _received.append(signal.Signals(signum))  # acted on at the next step boundary, never here


def requested() -> str | None:
    """The name of the first preemption signal this process received, if any."""
    return _received[0].name if _received else None


@contextmanager
def recording() -> Iterator[None]:
    """Record SIGTERM/SIGUSR1 instead of dying of them, for the duration of a run.

    Nested uses (the CLI's, then the run's own in the same process) keep what the outer
    one recorded; the outermost starts from nothing and restores the previous handlers.
    Signal handlers can only be set from the main thread: elsewhere this does nothing.
    """
    with _handling(_record) as previous:
        if previous is not None and not all(h is _record for h in previous.values()):
            _received.clear()
        yield


@contextmanager
def raising(make: Callable[[int], BaseException]) -> Iterator[None]:
    """For work that writes nothing until it ends (plan=true): a preemption signal, received
    before (while Hydra composed) or during the block, raises make(signum) at once."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise make(signum)

    if _received:
        raise make(int(_received[0]))
    with _handling(stop):
        yield


@contextmanager
def _handling(handler) -> Iterator[dict | None]:
    """`handler` for SIGNALS while the block runs, then the previous handlers again (which
    the block gets; None off the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield previous
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
