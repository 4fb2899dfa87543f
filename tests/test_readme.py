"""Every command of the README that can run on this machine runs, as written (end-to-end).

The README's ```bash blocks are read in order; each command line runs in one scratch
directory (with the repository's `examples/` beside it, as in a checkout), so that a later
block can use what an earlier one made (`runs/first`, `runs/llama`).  To keep the suite short, a training
run's `train.steps` is set to 2 (appended, or replacing the README's value): the command is
the README's otherwise, every key and option as a user would type it.  The ```python block
runs after the commands before it.  Not run here, by design:
- the two set-up commands (they install into a new venv: CI runs the second one itself);
- two torchrun agents on two hosts, and SLURM (no cluster here; the tests of those features
  run their loopback versions).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import readme_numbers  # noqa: E402

pytestmark = pytest.mark.e2e

# Commands that use what an earlier one made (runs/first/..., runs/llama/...) run in order, in one folder.
CHAINS = ("first", "llama")
NOT_HERE = ("pip install", "--nnodes", "hydra/launcher=slurm", "python -m pytest")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def commands(body: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def shortened(cmd: str) -> str:
    """Two training steps instead of the README's count (see the module's docstring)."""
    words = shlex.split(cmd)
    if not any(w in ("composerun", "torchrun") or w.endswith("composerun") for w in words):
        return cmd
    if any(w.startswith("plan=") for w in words):
        return cmd
    if any(w.startswith("train.steps=") for w in words):
        return re.sub(r"train\.steps=\d+", "train.steps=2", cmd)
    return cmd + " train.steps=2"


def steps() -> list[tuple[str, str]]:
    """(kind, what to run) for every runnable command and python block of the README, in order."""
    out: list[tuple[str, str]] = []
    for lang, body in blocks((REPO / "README.md").read_text()):
        if lang == "bash":
            out += [("sh", shortened(c)) for c in commands(body) if not any(s in c for s in NOT_HERE)]
        elif lang == "python":
            out.append(("python", body))
    return out


STEPS = steps()


def _run(kind: str, what: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = ["bash", "-c", what] if kind == "sh" else [sys.executable, "-c", what]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_has_the_commands_it_documents() -> None:
    joined = "\n".join(w for _, w in STEPS)
    for needed in ("mesh=2x4", "torchrun --nproc_per_node 8", "-m +model=unit,composite", "plan=true",
                   "'model.kwargs={depth: 3}'", "--config-dir", "composerun-ckpt export", "dcp.load",
                   "composerun-tokenize", "model.pretrained=", "--format hf", "AutoModelForCausalLM"):  # fmt: skip
        assert needed in joined, needed


def _folder(path: Path) -> Path:
    """A folder to run commands in, as a user's checkout of the repository (examples/)."""
    path.mkdir(parents=True)
    (path / "examples").symlink_to(REPO / "examples")
    return path


def test_every_command_of_the_readme_runs(tmp_path: Path) -> None:
    # independent commands two at a time, each in a folder of its own (two started in the same
    # second would get the same default run directory, outputs/<date>/<time>, and the second
    # be refused: it is in use); composerun-ckpt and the python block after what they read
    chains = {name: [s for s in STEPS if f"runs/{name}" in s[1]] for name in CHAINS}
    first = [s for s in STEPS if not any(f"runs/{name}" in s[1] for name in CHAINS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(
            pool.map(lambda i_s: (i_s[1], _run(*i_s[1], _folder(tmp_path / f"c{i_s[0]}"))), enumerate(first))
        )
    for name, chain in chains.items():  # each chain in order, in a folder of its own
        shared = _folder(tmp_path / name)
        results += [(s, _run(*s, shared)) for s in chain]
    failed = [
        f"{what!r}: exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}" for (_, what), r in results if r.returncode
    ]
    assert not failed, "\n".join(failed)
    assert len(results) >= 12
    # the outputs the README shows are what those commands print now (scripts/readme_numbers.py
    # regenerates them): every line of the kinds shown, exactly
    shown = readme_numbers.shown_outputs((REPO / "README.md").read_text())
    assert shown
    for command, block, _ in shown:
        out = next(r.stdout for (_, what), r in results if what == command)
        now = [line for line in out.splitlines() if line.startswith(readme_numbers.SHOWN)]
        assert block.splitlines() == now, f"README's output of {command!r} is stale: python scripts/readme_numbers.py --write"
