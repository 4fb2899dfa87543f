"""Every command of the README and of the docs/ pages that can run on this machine runs, as
written (end-to-end).

Each page (README.md, then docs/*.md) is read top to bottom: its ```bash commands and ```python
blocks run in order in one scratch folder of the page's own (with the repository's `examples/`
beside it, as in a checkout), so that a later command can use what an earlier one made
(`runs/first`, `runs/llama`); the pages run two at a time.  To keep the suite short, a training
run's `train.steps` is set to 2 (appended, or replacing the page's value): the command is the
page's otherwise, every key and option as a user would type it.  Not run here, by design:
- the two set-up commands (they install into a new venv: CI runs the second one itself);
- two torchrun agents on two hosts, and SLURM (no cluster here; the tests of those features
  run their loopback versions);
- `python -m pytest` (the suite itself).
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


def steps(text: str) -> list[tuple[str, str]]:
    """(kind, what to run) for every runnable command and python block of a page, in order."""
    out: list[tuple[str, str]] = []
    for lang, body in blocks(text):
        if lang == "bash":
            out += [("sh", shortened(c)) for c in commands(body) if not any(s in c for s in NOT_HERE)]
        elif lang == "python":
            out.append(("python", body))
    return out


# the README, then every page of docs/ (the pages readme_numbers.py regenerates outputs in)
STEPS = {page.relative_to(REPO).as_posix(): steps(page.read_text()) for page in readme_numbers.pages()}


def _run(kind: str, what: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = ["bash", "-c", what] if kind == "sh" else [sys.executable, "-c", what]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_has_the_commands_it_documents() -> None:
    """Every feature below is shown by a command that runs, on the README or a page of docs/."""
    joined = "\n".join(w for page in STEPS.values() for _, w in page)
    for needed in ("mesh=2x4", "torchrun --nproc_per_node 8", "-m +model=unit,composite", "plan=true",
                   "'model.kwargs={depth: 3}'", "--config-dir", "composerun-ckpt export", "dcp.load",
                   "composerun-tokenize", "model.pretrained=", "--format hf", "AutoModelForCausalLM"):  # fmt: skip
        assert needed in joined, needed


def _folder(path: Path) -> Path:
    """A folder to run commands in, as a user's checkout of the repository (examples/)."""
    path.mkdir(parents=True)
    (path / "examples").symlink_to(REPO / "examples")
    return path


def _run_page(page: str, folder: Path) -> list[tuple[tuple[str, str], subprocess.CompletedProcess]]:
    """A page's commands in order, in its own folder, as a reader runs them top to bottom (one
    after another: two started in the same second would get the same default run directory,
    outputs/<date>/<time>, and the second be refused as it is in use)."""
    return [(s, _run(*s, folder)) for s in STEPS[page]]


def test_every_command_of_the_readme_runs(tmp_path: Path) -> None:
    # the pages two at a time, the longest first, each page's commands in order in a folder of its own
    order = sorted(STEPS, key=lambda page: -len(STEPS[page]))
    with ThreadPoolExecutor(max_workers=2) as pool:
        ran = dict(
            zip(
                order,
                pool.map(lambda page: _run_page(page, _folder(tmp_path / page.replace("/", "_"))), order),
                strict=True,
            )
        )
    failed = [
        f"{page}: {what!r}: exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}"
        for page, results in ran.items()
        for (_, what), r in results
        if r.returncode
    ]
    assert not failed, "\n".join(failed)
    assert sum(map(len, ran.values())) >= 12
    # the outputs the pages show are what those commands print now (scripts/readme_numbers.py
    # regenerates them): every line of the kinds shown, exactly
    shown = [(page, s) for page in STEPS for s in readme_numbers.shown_outputs((REPO / page).read_text())]
    assert shown
    for page, (command, block, _) in shown:
        out = next(r.stdout for (_, what), r in ran[page] if what == command)
        now = [line for line in out.splitlines() if line.startswith(readme_numbers.SHOWN)]
        assert block.splitlines() == now, (
            f"{page}'s output of {command!r} is stale: python scripts/readme_numbers.py --write"
        )
