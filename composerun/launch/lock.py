"""One run at a time in a run directory (`RunLock`).

A double-submitted job would otherwise interleave metrics.jsonl and race on checkpoints.
The lock is a kernel lock (POSIX `lockf`, which NFS also passes between hosts) on the run
directory's lock file (composerun/rundir.py names it), whose content names the holder
(host, pid, start, command) and whose modification time is a heartbeat, renewed every few
seconds while the run lasts.  A dead holder's lock is taken over: its kernel lock went with
its process; where the file system keeps no kernel locks between hosts (some shared ones),
a record whose heartbeat stopped `STALE_S` ago, or whose process is gone from this host, is
stale.  The file stays (emptied) when the run ends: removing it would let a second run lock
a file that a third then recreates.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

from composerun.errors import ConfigError
from composerun.rundir import RunDir

HEARTBEAT_S = 5.0
STALE_S = 30.0  # a record whose heartbeat is older than this, on a file system without kernel locks, is stale


def _alive_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Held by the one process that writes the run directory's files (the launcher, rank 0
    under torchrun, the first task of a SLURM job) from before its first write to its end."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunDir(run_dir).lock
        self._fd: int | None = None
        self._made = False  # whether acquire() made the file (a directory no run had locked)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self, command: str) -> None:
        """Take the lock, or raise ConfigError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._made = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            kernel = self._kernel_lock(fd)
            holder = self._read(fd)
            if holder and (not kernel or holder.get("host") != socket.gethostname()) and self._live(holder):
                raise self._busy(holder)
            record = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": datetime.now().isoformat(timespec="seconds"),
                "command": command,
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)  # a kernel lock taken goes with the descriptor
            raise
        self._fd = fd
        self._beat = threading.Thread(target=self._heartbeat, name="composerun-lock", daemon=True)
        self._beat.start()

    def _kernel_lock(self, fd: int) -> bool:
        """True when this process now holds the kernel lock; False where the file system has
        none (the record decides then); ConfigError when another process holds it."""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise self._busy(self._read(fd)) from None
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise

    @staticmethod
    def _read(fd: int) -> dict | None:
        try:
            text = os.pread(fd, 65536, 0).decode(errors="replace").strip()
            record = json.loads(text) if text else None
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _live(self, holder: dict) -> bool:
        """Whether the record's run still lasts: its heartbeat is recent, and if it ran on this
        host, its process is there."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except OSError:
            return False
        if age > STALE_S:
            return False
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            return _alive_here(holder["pid"])
        return True

    def _busy(self, holder: dict | None) -> ConfigError:
        run_dir = self.path.parent
        who = "another composerun run"
        if holder:
            who += f" (pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
            who += f": {holder['command']})" if holder.get("command") else ")"
        return ConfigError(
            f"hydra.run.dir={run_dir} is in use by {who}; wait for it to end, or choose another hydra.run.dir"
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self, started: bool = True) -> None:
        """Give the lock up.  A command that held it only to decide where its run starts, and
        did not start it (refused, or a finished run's results reported), removes the file
        if it made it: an existing directory is left as it was."""
        if self._fd is None:
            return
        if not started and self._made:
            self.path.unlink(missing_ok=True)
        self._stop.set()
        try:
            os.ftruncate(self._fd, 0)  # no holder; the file stays (see the module's docstring)
        except OSError:
            pass
        os.close(self._fd)  # the kernel lock goes with it
        self._fd = None
