"""Many `composerun` command lines, one after another in one process.

Most of a command that fails its checks (exit 2 before any rank starts) is Python importing
torch and Hydra.  A test of many such commands runs them here: each through the function the
`composerun` script calls (composerun.main) with its argv, in its own directory, its stdout and
stderr captured at the file descriptors (so what a C++ warning writes is caught too), its exit
code that of the SystemExit.  For commands that start no rank and need no environment of their
own: a signal, a sweep, torchrun's variables or a process of their own are tested as typed.

    python scripts/one_process.py COMMANDS.json    # [{"args": [...], "cwd": DIR}, ...]

writes COMMANDS.json.out: [{"code": N, "stdout": ..., "stderr": ..., "seconds": S}, ...];
`run_commands` starts that process and returns a CompletedProcess per command (with `.seconds`).

Commands that start ranks, or need an environment of their own, fork instead:

    python scripts/one_process.py --fork    # a JSON line per command on stdin

imports what a command imports once, then forks one child per command, which sets its argv,
directory, environment, signals and file descriptors as a shell would, calls the console
script's function and exits as the interpreter would: a command as typed, less the seconds of
its imports.  `Forks` starts that process and hands out a `Forked` (pid, poll, wait) per
command.  Not for a command about its own start-up (a signal while it imports).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def run_commands(commands: list[tuple], timeout: float = 1800) -> list[subprocess.CompletedProcess]:
    """`composerun ARGS` in CWD for each (ARGS, CWD), all in one new process, in order; an
    (ARGS, CWD, PROG) runs another console script of composerun's."""
    with tempfile.TemporaryDirectory(prefix="composerun-one-process-") as tmp:
        todo = Path(tmp) / "commands.json"
        todo.write_text(
            json.dumps([{"args": list(c[0]), "cwd": str(c[1]), "prog": (*c, "composerun")[2]} for c in commands])
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
        r = subprocess.run(
            [sys.executable, __file__, str(todo)],
            env={**env, "PYTHONWARNINGS": "ignore"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        done = Path(f"{todo}.out")
        if r.returncode != 0 or not done.is_file():
            raise RuntimeError(
                f"the process of {len(commands)} commands failed (exit {r.returncode}): {r.stderr[-3000:]}"
            )
        results = json.loads(done.read_text())
    out = []
    for command, res in zip(commands, results, strict=True):
        prog = (*command, "composerun")[2]
        proc = subprocess.CompletedProcess([prog, *command[0]], res["code"], res["stdout"], res["stderr"])
        proc.seconds = res["seconds"]  # type: ignore[attr-defined]
        out.append(proc)
    return out


def run_here(args: list[str], cwd: Path, prog: str = "composerun") -> tuple[int, str, str]:
    """`PROG ARGS` in CWD, in this process: (exit code, stdout, stderr)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    import composerun.cli  # noqa: F401  (its import registers the schema, which the snapshot below must hold)

    # What one command leaves behind in the process (its own error and sweep report are its
    # own): Hydra initialised, the mesh shapes its argv registered (`mesh=3x2`).
    GlobalHydra.instance().clear()
    meshes = dict(ConfigStore.instance().repo.get("mesh", {}))
    argv, here = sys.argv, os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            os.chdir(cwd)
            sys.argv = [prog, *args]
            raise SystemExit(console_script(prog)())
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:  # what the interpreter would print, and its exit code
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            os.chdir(here)
            sys.argv = argv
            ConfigStore.instance().repo["mesh"] = meshes
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def console_script(prog: str) -> Any:
    """The function the console script `prog` calls (its return value is the exit code)."""
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name=prog)
    return entry.load()


def _no_fork_server(*args: Any) -> None:
    """In place of agent.prestart_fork_server: it starts the ranks' fork server early, while the
    command checks its config; these commands fail their checks, and this process stays alone."""


# --- one forked child per command ------------------------------------------------------------


class Forked:
    """A command the fork process started: what a test needs of its Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode


class Forks:
    """The fork process (`--fork`), started once; `start` runs one command in a child of it."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--fork"],
            env={**env, "PYTHONWARNINGS": "ignore"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._lock = threading.Lock()
        self._next = 0
        self._started: dict[int, list[Any]] = {}  # id -> [the Event of its pid, its Forked once started]
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def start(self, prog: str, args: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path) -> Forked:
        """`prog ARGS` in CWD with ENV (the whole environment), stdout and stderr to OUT and ERR."""
        came = threading.Event()
        with self._lock:
            self._next += 1
            n = self._next
            self._started[n] = started = [came, None]
            line = {"id": n, "prog": prog, "args": args, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(line) + "\n").encode())
            self._proc.stdin.flush()
        if not came.wait(600):  # a guard against a hang, not a measure of speed
            raise RuntimeError(f"the fork process started no child for {prog} {args}")
        return started[1]  # (a command that has ended by now is no longer in _started)

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            msg = json.loads(raw)
            if "pid" in msg:
                started = self._started[msg["id"]]
                started[1] = Forked(msg["pid"])
                started[0].set()
            else:
                forked = self._started.pop(msg["id"])[1]
                forked.returncode = msg["code"]
                forked._done.set()

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=60)


# What a command imports on its way to its ranks (composerun imports torch only once the config
# has passed its own checks), imported once by the fork process: a child skips those seconds.
PRELOAD = [
    "composerun.cli",
    "composerun.launch.job",
    "composerun.launch.agent",
    "composerun.launch.preflight",
    "composerun.checkpoint.cli",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.launcher.api",
]


def serve_forks() -> None:
    """Read a command a line from stdin, fork a child for it, answer its pid, then its exit code."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)

    requests, answers = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    children: dict[int, int] = {}  # pid -> the command's id
    pending, reading = b"", True
    while reading or children:
        ready, _, _ = select.select([requests] if reading else [], [], [], 0.05 if children else None)
        if ready:
            chunk = os.read(requests, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in filter(None, lines):
                command = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    os.close(answers)
                    _forked_command(command)  # never returns
                children[pid] = command["id"]
                os.write(answers, (json.dumps({"id": command["id"], "pid": pid}) + "\n").encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)  # -N for a signal, as Popen says it
            os.write(answers, (json.dumps({"id": children.pop(pid), "code": code}) + "\n").encode())


def _forked_command(command: dict[str, Any]) -> None:
    """In the child: the command as a shell starts it (its own session, stdin from /dev/null,
    SIGINT acting), then the console script's function, then the interpreter's exit."""
    import atexit
    import traceback
    import types

    code = 1
    try:
        os.setsid()
        for fd, path in ((1, command["out"]), (2, command["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.chdir(command["cwd"])
        os.environ.clear()
        os.environ.update(command["env"])
        extra = [os.path.abspath(p) for p in command["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        script = str(Path(sys.executable).parent / command["prog"])
        sys.path[0] = os.path.dirname(script)  # (the script's folder, not this one's)
        sys.argv = [script, *command["args"]]
        # the console script is the main module (multiprocessing's fork server imports it again)
        main = types.ModuleType("__main__")
        main.__file__ = script
        sys.modules["__main__"] = main
        try:
            raise SystemExit(console_script(command["prog"])())
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # what the interpreter prints, and its exit code
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  (the interpreter's exit, in its order)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream has nothing left to say
                pass
        os._exit(code & 0xFF)


def main() -> None:
    if sys.argv[1:] == ["--fork"]:
        serve_forks()
        return
    from composerun.launch import agent

    agent.prestart_fork_server = _no_fork_server  # (launch/job.py calls it there: agent.prestart_fork_server)
    todo = Path(sys.argv[1])
    results = []
    for command in json.loads(todo.read_text()):
        t0 = time.monotonic()
        code, out, err = run_here(command["args"], Path(command["cwd"]), command["prog"])
        results.append({"code": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - t0})
    Path(f"{todo}.out").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
