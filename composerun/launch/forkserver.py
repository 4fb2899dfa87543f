"""Imported by the fork server that forks the ranks (launch.start_method=forkserver), and
nowhere else: it is the first module of launch.RANK_MODULES, which only the fork server imports.

SLURM and Kubernetes end a job with a signal to its whole process group.  The fork server is
in that group; dying of SIGTERM (or SIGHUP), it would take its ranks with it (through their
parent-death signal) before they could checkpoint.  It ignores those signals, and SIGINT too
(multiprocessing ignores it only once the imports that follow this module are done: Ctrl-C in
the first seconds printed a KeyboardInterrupt traceback from here), and exits when the
launcher does (multiprocessing's own rule).  A forked rank inherits the ignored signals and
sets its own handlers first thing (preempt.rank_signals).

A rank the fork server forks just as the launcher stops (a job's signal in its first seconds)
finds the launcher's semaphores already removed when it reads its start-up state, and the fork
server prints that child's error through sys.excepthook: a traceback after the launcher's own
line, for a rank that never started.  That one error is dropped (`quiet_abandoned_start`).
"""

import signal
import sys
from types import TracebackType

for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
    signal.signal(_sig, signal.SIG_IGN)
# the launcher started this interpreter with SIGINT and SIGTERM held (launch/signals.py
# helpers_ignore_group_signals: a Ctrl-C while it imported multiprocessing would have ended it
# with a traceback); ignored now, they are let through (one held meanwhile is dropped), so
# that the ranks forked from here start with none held
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def quiet_abandoned_start(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """sys.excepthook: silent for a rank whose start-up state names a semaphore its launcher
    has removed (FileNotFoundError from multiprocessing's SemLock rebuild), else Python's own."""
    last = tb
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    code = last.tb_frame.f_code if last is not None else None
    abandoned = (
        issubclass(kind, FileNotFoundError)
        and code is not None
        and code.co_name == "__setstate__"
        and code.co_filename.replace("\\", "/").endswith("multiprocessing/synchronize.py")
    )
    if not abandoned:
        sys.__excepthook__(kind, value, tb)


sys.excepthook = quiet_abandoned_start
