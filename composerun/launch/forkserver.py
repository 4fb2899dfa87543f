"""Imported by the fork server that forks the ranks (launch.start_method=forkserver), and
nowhere else: it is the first module of launch.RANK_MODULES, which only the fork server imports.

SLURM and Kubernetes end a job with a signal to its whole process group.  The fork server is
in that group; dying of SIGTERM (or SIGHUP), it would take its ranks with it (through their
parent-death signal) before they could checkpoint.  It ignores those signals, and SIGINT too
(multiprocessing ignores it only once the imports that follow this module are done: Ctrl-C in
the first seconds printed a KeyboardInterrupt traceback from here), and exits when the
launcher does (multiprocessing's own rule).  A forked rank inherits the ignored signals and
sets its own handlers first thing (preempt.rank_signals).
"""

import signal

for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
    signal.signal(_sig, signal.SIG_IGN)
