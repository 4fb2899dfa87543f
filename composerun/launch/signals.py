"""Preemption: SIGTERM or SIGUSR1 stops the run at the next step boundary, with a checkpoint.

A scheduler announces the end of a job with a signal (SLURM: SIGTERM before its kill, and
SIGUSR1 with `--signal=USR1@SECONDS`).  In a rank, the handler only records the signal:
saving from inside a signal handler would interrupt a collective or a half-written file.
The training loop reads the record once per step and carries it in the step's existing
all-reduce, so every rank agrees to stop after the same step without an extra collective;
then every rank checkpoints that step and the process exits with PREEMPTED_EXIT_CODE.

The self-launching parent runs torch's elastic agent, which already forwards the signals
it handles to the ranks (the signal it got, not a kill) and waits `shutdown_timeout`
seconds before SIGKILL (torch/distributed/elastic/agent/server/api.py, `run`, and
multiprocessing/api.py, `_close`).  composerun adds SIGUSR1 to the signals it handles and
gives the agent the same behaviour before the ranks exist (`agent_handlers`).

SIGINT is left alone: Ctrl-C stays an immediate stop, except while the launcher imports torch
(`interrupt_deferred`), which it then interrupts as soon as the import is done.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from composerun.stopping import SIGNALS, _handling, _received, _record

# A command started under `nohup` (SIGHUP ignored) must survive a hangup: neither the agent
# nor the ranks may then handle it.  Read once, before anything sets a handler.
HUP_IGNORED = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def agent_signals() -> str:
    """What the self-launch agent handles and forwards to the ranks: torch's default set, plus
    SIGUSR1, less SIGHUP under nohup."""
    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"]
    return ",".join(n for n in names if not (n == "SIGHUP" and HUP_IGNORED))


def rank_signals(ignore_hup: bool) -> None:
    """What a self-launched rank does on each signal, set first thing in the rank.  The fork
    server it comes from ignores SIGTERM, SIGUSR1 and SIGHUP (composerun/launch/forkserver.py: a
    signal to the whole process group must not kill it, or its ranks die with it), and a
    forked rank inherits that: SIGTERM/SIGUSR1 are recorded (a preemption, acted on at the
    next step boundary), SIGHUP stops the rank unless the command ignores it (nohup)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        signal.signal(s, _record)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hup else signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt)  # Ctrl-C: an immediate stop
    _parent_death_signal(signal.SIGTERM)


def _interrupt(signum: int, frame: object) -> None:
    """A rank's Ctrl-C: KeyboardInterrupt once.  The process group's SIGINT reaches the rank, and
    torch's agent forwards the one it got too: a second must not interrupt the rank's exit (its
    multiprocessing finalizers printed a KeyboardInterrupt traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Ctrl-C held until the block ends, then KeyboardInterrupt.  For torch's import (seconds on
    a busy machine): its C++ start-up calls back into Python and drops an error raised there, so
    a KeyboardInterrupt inside it is lost (the run went on as if no Ctrl-C had come) or leaves
    NumPy half-imported (the next import of it fails).  Does nothing off the main thread, or
    where SIGINT has a handler other than Python's default."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        raise KeyboardInterrupt


@contextmanager
def helpers_ignore_group_signals() -> Iterator[None]:
    """While multiprocessing starts its helper processes (the resource tracker, the fork
    server): SIGUSR1 and SIGHUP ignored, so that they inherit it, and SIGINT and SIGTERM held.  The resource tracker
    ignores SIGINT and SIGTERM itself, but dies of a process group's SIGUSR1 (SLURM's
    warning signal), and the next one started prints KeyError tracebacks for what the dead
    one had registered."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGUSR1, signal.SIGHUP)}
    # SIGINT and SIGTERM held back (not lost: this process gets them when the helper has
    # started), so that a helper started now (its interpreter inherits the mask) is not
    # stopped by a Ctrl-C with a traceback while it imports; it lets them through once it
    # ignores them (launch/forkserver.py; the resource tracker does the same itself)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for s, h in previous.items():
            signal.signal(s, h)


def _parent_death_signal(sig: int) -> None:
    """The signal this process gets when its parent dies (Linux; torch's own spawn wrapper sets
    SIGINT, which would stop the rank at once with no checkpoint)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch_launcher(pid: int, grace_s: float, on_gone: Callable[[], None] | None = None) -> threading.Thread | None:
    """In a self-launched rank: when the launcher (`pid`) is gone (SIGKILLed, say), nothing
    supervises the ranks any more; each one then stops as if preempted (at the next step
    boundary, with a checkpoint) and, if that has not happened after `grace_s` seconds,
    exits at once.  `on_gone` runs first (rank 0 takes over the run directory's lock: the
    launcher's died with it, and a command started now must not write beside this save)."""
    import os
    import time

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None  # no pidfd here (Linux < 5.3): look every second
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass
        except OSError:
            return None  # not ours to watch

    def watch() -> None:
        import select

        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(1.0)
        import logging

        logging.getLogger("composerun").warning(
            "the launcher (pid %d) is gone: stopping at the next step boundary, at the latest in %.0f s", pid, grace_s
        )
        if on_gone is not None:
            try:
                on_gone()
            except Exception:  # noqa: BLE001 - another run took the directory: stop now, write nothing
                logging.getLogger("composerun").exception("the run directory is no longer this run's")
                os._exit(128 + signal.SIGTERM)
        _received.append(signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="composerun-launcher-watch", daemon=True)
    thread.start()
    return thread


@contextmanager
def agent_handlers() -> Iterator[None]:
    """While the elastic agent launches: a preemption signal raises torch's SignalException,
    as the agent's own handlers do once the ranks are started (before that, during the
    rendezvous, nothing would stop the launch)."""
    from torch.distributed.elastic.multiprocessing import SignalException

    def raise_signal(signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        raise SignalException(f"got {sig.name}", sigval=sig)

    # the agent installs its own handlers for every signal it handles and never removes them:
    # the caller's come back when this ends
    with _handling(raise_signal):
        yield
