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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run_commands(commands: list[tuple[list[str], Path]], timeout: float = 1800) -> list[subprocess.CompletedProcess]:
    """`composerun ARGS` in CWD for each (ARGS, CWD), all in one new process, in order."""
    with tempfile.TemporaryDirectory(prefix="composerun-one-process-") as tmp:
        todo = Path(tmp) / "commands.json"
        todo.write_text(json.dumps([{"args": list(args), "cwd": str(cwd)} for args, cwd in commands]))
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
            raise RuntimeError(f"the process of {len(commands)} commands failed (exit {r.returncode}): {r.stderr[-3000:]}")
        results = json.loads(done.read_text())
    out = []
    for (args, _), res in zip(commands, results, strict=True):
        proc = subprocess.CompletedProcess(["composerun", *args], res["code"], res["stdout"], res["stderr"])
        proc.seconds = res["seconds"]  # type: ignore[attr-defined]
        out.append(proc)
    return out


def run_here(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """`composerun ARGS` in CWD, in this process: (exit code, stdout, stderr)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    import composerun
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
            sys.argv = ["composerun", *args]
            composerun.main()
            code = 0
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


def _no_fork_server(*args: Any) -> None:
    """In place of agent.prestart_fork_server: it starts the ranks' fork server early, while the
    command checks its config; these commands fail their checks, and this process stays alone."""


def main() -> None:
    from composerun.launch import agent

    agent.prestart_fork_server = _no_fork_server  # (launch/job.py calls it there: agent.prestart_fork_server)
    todo = Path(sys.argv[1])
    results = []
    for command in json.loads(todo.read_text()):
        t0 = time.monotonic()
        code, out, err = run_here(command["args"], Path(command["cwd"]))
        results.append({"code": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - t0})
    Path(f"{todo}.out").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
