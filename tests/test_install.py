"""End-to-end tier: the documented commands against real installs, from a checkout's root and
from elsewhere.

The rest of the suite runs on the developer's editable install, whose import hook finds a
package however the checkout lays it out; a user's `pip install .` copies the package into
site-packages instead.  At the root of a checkout, `python -m composerun` and
`torchrun -m composerun` import the checkout's own composerun/ (the current directory comes
first on sys.path), so that folder must be the whole package, its configs included.

Each install is a venv of its own that sees this interpreter's site-packages (torch, Hydra)
only as a path, never as a site directory: the suite's own editable install (a .pth hook
there) stays out of it, as it would on a user's machine.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


def _install(root: Path, editable: bool) -> tuple[Path, Path]:
    """A copy of the checkout (setuptools writes build/ beside the sources) installed into a
    venv of its own; returns (the copy, the venv's bin/)."""
    src, venv = root / "checkout", root / "venv"
    shutil.copytree(REPO / "composerun", src / "composerun", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, *(["-e"] if editable else []), str(src)], check=True, capture_output=True, env=_env())
    return src, venv / "bin"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _run(cmd: list, cwd: Path, what: str) -> None:
    res = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{what}: {res.stderr[-2000:]}"


def test_plain_install_runs_from_the_root_and_elsewhere(tmp_path: Path) -> None:
    src, bin_dir = _install(tmp_path, editable=False)
    py, run = str(bin_dir / "python"), tmp_path / "run"
    # at the root, the checkout's composerun/ is the one imported: a real step, and every
    # torchrun rank composing the config (its Hydra runs in each rank)
    _run([py, "-m", "composerun", "+model=unit", "train.steps=1", f"hydra.run.dir={run}"], src, "python -m composerun")
    assert (run / "summary.json").is_file()
    torchrun = [py, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "composerun"]
    _run([*torchrun, "+model=unit", "--cfg", "job"], src, "torchrun -m composerun at the root")
    # elsewhere, the installed package
    _run([str(bin_dir / "composerun"), "+model=unit", "--cfg", "job"], tmp_path, "composerun elsewhere")


def test_editable_install_runs_from_the_root(tmp_path: Path) -> None:
    # (elsewhere, the editable console script is what every other end-to-end test runs)
    src, bin_dir = _install(tmp_path, editable=True)
    _run([str(bin_dir / "python"), "-m", "composerun", "+model=unit", "--cfg", "job"], src, "python -m composerun")
