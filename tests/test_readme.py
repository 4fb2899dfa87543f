"""Every command of the README and of the docs/ pages that can run on this machine runs, as
written (end-to-end).

Each page (README.md, then docs/*.md) is read top to bottom: its ```bash commands and ```python
blocks run in order in one scratch folder of the page's own (with the repository's `examples/`
beside it, as in a checkout), so that a later command can use what an earlier one made
(`runs/first`, `runs/llama`); the pages run two at a time.  To keep the suite short, a training
run's `train.steps` is set to 2 (appended, or replacing the page's value): the command is the
page's otherwise, every key and option as a user would type it.  A command of composerun's own
console scripts (`composerun`, `composerun-ckpt`, `composerun-tokenize`, with the page's
`VAR=value` prefix if any) runs forked from one process that has imported them
(scripts/one_process.py): its argv, folder, environment and session as a shell gives them, less
the seconds of its imports.  The README's first command (whose done line is checked here),
`torchrun`, `python -m composerun` and the python blocks run as typed, each a process of its own.
Not run here, by design:
- the two set-up commands (they install into a new venv: CI runs the second one itself);
- two torchrun agents on two hosts, and SLURM (no cluster here; the tests of those features
  run their loopback versions);
- `python -m pytest` (the suite itself).

Two of the README's runs are also read closely, the end-to-end checks of what a user sees:
`composerun +model=composite mesh=2x4` (every artifact of a self-launched run of 8 ranks, its
done line, its plan against plan=true's) and its torchrun twin (one run directory, one .hydra/).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO, check_estimate, latest_name, patience, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
import readme_numbers  # noqa: E402
from one_process import Forks  # noqa: E402

pytestmark = pytest.mark.e2e

NOT_HERE = ("pip install", "--nnodes", "hydra/launcher=slurm", "python -m pytest")
# composerun's console scripts, forked from one process that has imported them
FORKED = ("composerun", "composerun-ckpt", "composerun-tokenize")
FIRST = "composerun +model=composite mesh=2x4 train.steps=2"  # the README's first command, shortened
TORCHRUN = "torchrun --nproc_per_node 8 -m composerun +model=composite mesh=2x4 train.steps=2"


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


def forked_parts(what: str) -> tuple[dict[str, str], str, list[str]] | None:
    """(the VAR=value prefix, the console script, its argv) of a command of composerun's own
    console scripts with nothing else of the shell in it (no pipe, redirection, list or
    expansion); None for any other command (it runs in bash)."""
    if any(c in what for c in "|&;<>$`()*?"):
        return None
    words, env = shlex.split(what), {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return (env, words[0], words[1:]) if words and words[0] in FORKED and what != FIRST else None


@dataclass
class Ran:
    """A page's command, run: its result, the seconds the test waited for it, and the run
    directories (each with its .hydra/) that appeared while it ran."""

    what: str
    result: subprocess.CompletedProcess
    waited: float
    made: list[Path] = field(default_factory=list)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    return {**env, "PYTHONWARNINGS": "ignore", "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", **extra}


def _run(kind: str, what: str, cwd: Path, forks: Forks, logs: Path) -> subprocess.CompletedProcess:
    parts = forked_parts(what) if kind == "sh" else None
    if parts is None:
        cmd = ["bash", "-c", what] if kind == "sh" else [sys.executable, "-c", what]
        return subprocess.run(cmd, cwd=cwd, env=_env({}), capture_output=True, text=True, timeout=patience(300))
    env, prog, args = parts
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout", logs / "stderr"
    proc = forks.start(prog, args, cwd, _env(env), out, err)
    try:
        code = proc.wait(patience(300))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess([prog, *args], code, out.read_text(), err.read_text())


def _run_dirs(folder: Path) -> set[Path]:
    return {p.parent for p in folder.rglob(".hydra")}


def _run_page(page: str, folder: Path, forks: Forks, logs: Path) -> list[Ran]:
    """A page's commands in order, in its own folder, as a reader runs them top to bottom (one
    after another: two started in the same second would get the same default run directory,
    outputs/<date>/<time>, and the second be refused as it is in use)."""
    ran = []
    for i, (kind, what) in enumerate(STEPS[page]):
        before, t0 = _run_dirs(folder), time.time()
        r = _run(kind, what, folder, forks, logs / str(i))
        ran.append(Ran(what, r, time.time() - t0, sorted(_run_dirs(folder) - before)))
    return ran


def _folder(path: Path) -> Path:
    """A folder to run commands in, as a user's checkout of the repository (examples/)."""
    path.mkdir(parents=True)
    (path / "examples").symlink_to(REPO / "examples")
    return path


@pytest.fixture(scope="module")
def forks():
    forks = Forks()
    yield forks
    forks.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory, forks: Forks) -> dict[str, list[Ran]]:
    """Every page's commands: the pages two at a time, the longest first, each page's commands
    in order in a folder of its own."""
    root, logs = tmp_path_factory.mktemp("pages"), tmp_path_factory.mktemp("logs")
    order = sorted(STEPS, key=lambda page: -len(STEPS[page]))
    name = lambda page: page.replace("/", "_")  # noqa: E731
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda page: _run_page(page, _folder(root / name(page)), forks, logs / name(page)), order)
        return dict(zip(order, done, strict=True))


def test_the_readme_has_the_commands_it_documents() -> None:
    """Every feature below is shown by a command that runs, on the README or a page of docs/."""
    joined = "\n".join(w for page in STEPS.values() for _, w in page)
    for needed in ("mesh=2x4", "torchrun --nproc_per_node 8", "-m +model=unit,composite", "plan=true",
                   "'model.kwargs={depth: 3}'", "--config-dir", "composerun-ckpt export", "dcp.load",
                   "composerun-tokenize", "model.pretrained=", "--format hf", "AutoModelForCausalLM"):  # fmt: skip
        assert needed in joined, needed
    assert FIRST in joined and TORCHRUN in joined  # the two read closely below


def test_the_forked_commands_are_the_console_scripts_alone() -> None:
    """What runs forked is exactly a console script's argv and its environment prefix."""
    page = "PYTHONPATH=examples/user_model composerun +model=unit 'model.kwargs={depth: 3}' train.steps=2"
    assert forked_parts(page) == ({"PYTHONPATH": "examples/user_model"}, "composerun",
                                  ["+model=unit", "model.kwargs={depth: 3}", "train.steps=2"])  # fmt: skip
    assert forked_parts("composerun-ckpt inspect runs/first | head") is None
    for typed in (FIRST, TORCHRUN, "python -m composerun +model=unit train.steps=2", "ls runs"):
        assert forked_parts(typed) is None, typed
    forked = [w for page in STEPS.values() for kind, w in page if kind == "sh" and forked_parts(w)]
    assert len(forked) >= 15 and any(w.startswith("composerun-tokenize") for w in forked)


def test_every_command_of_the_readme_runs(pages: dict[str, list[Ran]]) -> None:
    failed = [
        f"{page}: {r.what!r}: exit {r.result.returncode}: {(r.result.stderr or r.result.stdout)[-800:]}"
        for page, results in pages.items()
        for r in results
        if r.result.returncode
    ]
    assert not failed, "\n".join(failed)
    assert sum(map(len, pages.values())) >= 12
    # the outputs the pages show are what those commands print now (scripts/readme_numbers.py
    # regenerates them): every line of the kinds shown, exactly
    shown = [(page, s) for page in STEPS for s in readme_numbers.shown_outputs((REPO / page).read_text())]
    assert shown
    for page, (command, block, _) in shown:
        out = next(r.result.stdout for r in pages[page] if r.what == command)
        now = [line for line in out.splitlines() if line.startswith(readme_numbers.SHOWN)]
        assert block.splitlines() == now, (
            f"{page}'s output of {command!r} is stale: python scripts/readme_numbers.py --write"
        )


def _readme(pages: dict[str, list[Ran]], what: str) -> Ran:
    ran = next(r for r in pages["README.md"] if r.what == what)
    assert ran.result.returncode == 0, ran.result.stderr[-2000:]
    return ran


def test_the_readmes_first_command_self_launches_8_ranks_into_one_run_dir(
    pages: dict[str, list[Ran]], forks: Forks, tmp_path: Path
) -> None:
    """`composerun +model=composite mesh=2x4`: 8 local ranks, one run directory with every artifact."""
    ran = _readme(pages, FIRST)
    (run,) = ran.made
    assert sorted(p.name for p in run.rglob("config.yaml")) == ["config.yaml"]  # .hydra/ written once
    assert (run / ".hydra" / "config.yaml").read_text().count(
        "_target_: composerun.models.reference.CompositeModel"
    ) == 1
    assert sorted(p.name for p in run.glob("rank*.log")) == [f"rank{r}.log" for r in range(8)]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2]
    for key in ("loss", "grad_norm", "lr", "step_s", "samples_per_s", "peak_mem_bytes"):
        assert key in rows[-1]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["world_size"] == 8 and plan["mesh"] == "2x4"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2
    latest = latest_name(run / "checkpoints")
    assert latest == "step-00000002" and (run / "checkpoints" / latest / ".metadata").is_file()
    # the done line (once) gives the time the user waited, and what the start-up went to (most of
    # it, for 2 small steps); the ranks' own line, with their time only, is in rank0.log
    out = ran.result.stdout
    [done] = [line for line in out.splitlines() if line.startswith("composerun: done:")]
    assert done.startswith("composerun: done: composite on mesh 2x4 (fsdp), 2 steps"), done
    found = re.search(r"ms/step, ([\d.]+) s \(imports and config ([\d.]+) s, checks", done)
    said, imports = float(found.group(1)), float(found.group(2))
    # the command's time: its start-up and the ranks' (not the ranks' alone), and no more than the
    # test waited (which also holds the command's exit after the line: long on a loaded machine)
    assert summary["wall_s"] + imports <= said <= ran.waited, (done, ran.waited)
    assert "starting 8 ranks" in done and "training and saving" in done
    assert "composerun: done:" in (run / "rank0.log").read_text()
    # stdout is no terminal here (as under nohup or SLURM): a plain line per logged step instead of a bar
    assert re.search(r"^step 2/2: loss [\d.]+, lr [\d.e-]+, [\d.]+ ms/step$", out, re.M), out[-2000:]
    assert "step 1/2: loss" in (run / "rank0.log").read_text()

    # plan=true on the same command, one process on torch's fake process group, writes the very
    # same plan.json, and its estimate of the peak beside it, within 10 % of the peak every rank measured
    args = [*shlex.split(FIRST)[1:], "plan=true", "hydra.run.dir=planned"]
    proc = forks.start("composerun", args, tmp_path, _env({}), tmp_path / "stdout", tmp_path / "stderr")
    assert proc.wait(patience(300)) == 0, (tmp_path / "stderr").read_text()[-2000:]
    planned = json.loads((tmp_path / "planned" / "plan.json").read_text())
    check_estimate(planned.pop("estimate"), summary, "composite 2x4")
    assert planned == plan


def test_torchrun_ranks_share_one_run_dir(pages: dict[str, list[Ran]]) -> None:
    """The README's torchrun command: every one of its 8 ranks runs Hydra, yet there is one run
    directory, and one .hydra/ (in it)."""
    ran = _readme(pages, TORCHRUN)
    (run,) = ran.made
    assert len(list(run.rglob(".hydra"))) == 1
    assert {p.name for p in run.glob("rank*.log")} == {f"rank{r}.log" for r in range(8)}
    assert not (run / "torchelastic").exists()  # torchrun started the ranks, not composerun's agent
    assert [row["step"] for row in read_metrics(run)] == [1, 2]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 8


PLAN_8B = ("composerun +model=llama3_8b mesh=8x8 sharding=fsdp_blocks_ac plan=true plan.device=H100 "
           "data.batch_size=64 sharding.param_dtype=bfloat16")


def test_the_planning_pages_8b_fits_on_64_h100s_with_its_reserve(pages: dict[str, list[Ran]]) -> None:
    """docs/planning.md's command: llama3_8b, mesh 8x8, fsdp_blocks_ac, bf16, an H100, batch 64; fits
    with a stated reserve (the allocator's fragmentation, FSDP's stream pools, the CUDA context,
    NCCL's buffers), and the largest micro-batch is decided with it."""
    ran = next(r for r in pages["docs/planning.md"] if r.what == PLAN_8B)
    assert ran.result.returncode == 0, ran.result.stderr[-2000:]
    out = ran.result.stdout
    assert "estimated peak per rank: " in out and "without activation checkpointing" in out
    assert "fits in 79.6 GiB per rank with" in out and "the largest micro-batch that fits is" in out
    assert "with a reserve of" in out and "reserved by the allocator" in out
    assert "estimated step on H100: " in out and "tokens/s (" in out and "MFU" in out
    (run,) = ran.made
    plan = json.loads((run / "plan.json").read_text())
    e = plan["estimate"]
    assert len(e["peak_bytes_per_rank"]) == 64 and e["micro_batch"] == 1
    m = e["memory"]
    assert m["fits"] is True and m["largest_micro_batch"] >= 1
    reserve = e["reserve"]
    assert (
        m["needed_bytes"] == max(e["peak_reserved_bytes_per_rank"]) + reserve["cuda_context"] + reserve["nccl_buffers"]
    )
    assert m["needed_bytes"] > max(e["peak_bytes_per_rank"]) + reserve["fragmentation"]
    assert {"params", "activations", "optimizer", "unsharded_params"} <= set(e["breakdown"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["est_fits"] is True and summary["est_peak_bytes"] == max(e["peak_bytes_per_rank"])
