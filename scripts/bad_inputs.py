"""A catalog of bad inputs and faults, each run as a user types it, with what must hold.

    python scripts/bad_inputs.py [--jobs 2] [--only ID,ID] [--family config,...] [--out DIR] [--as-typed]

Families: config, mesh, rules, checkpoints, data, sweeps, environment, signals, disk, ckpt-cli.
Every case runs `composerun` (or `composerun-ckpt`) in a directory of its own and checks:

- the exit code (2 for a user's mistake found before any rank starts, 1 for a failure found
  while running, 75 preempted, 128+N for a stopping signal, 0 for a fault that must be
  survived);
- one line: a failing command prints exactly one `composerun...:` line on stderr (matching
  the case's pattern) and no traceback anywhere; a passing one prints no error line;
- nothing lost: the run directory it was pointed at is byte-for-byte as before (exit 2), or
  keeps every file it had (a run that started: logs may grow, its records may be added to),
  and a command that failed its checks in a new directory leaves no directory behind;
- the case's own check (the checkpoint it must have saved, the file it must not delete...).

The config-only cases run one after another in one worker process, through the function the
script calls (much of a case is Python importing torch).  The other cases, but a sample
(AS_TYPED_SAMPLE) and those signalled before they have surely started, fork from one process
that has done those imports (scripts/one_process.py --fork), each child a command as typed
otherwise.  `--as-typed` runs every case as its own command.  The table at the end counts the
cases that hold all of these; exit 0 only if every case does.
The suite runs the whole catalog (tests/test_bad_inputs.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
UNIT = ("+model=unit", "model.dim=16")  # the model of most cases: tiny, trains in milliseconds
FINISHED_ARGS = (*UNIT, "mesh=2", "train.steps=4", "checkpoint.every=2")  # the run many cases start from
# A guard against a hang, not a measure of speed: a loaded machine (the suite beside other work)
# took more than 180 s for a sweep of two jobs that takes 30 s alone.
RUN_TIMEOUT = 600


@dataclass
class Case:
    id: str
    family: str
    what: str
    args: tuple[str, ...]
    code: int  # the exit code that must come
    line: str | None = None  # a regex the one composerun line must match (search)
    given: str | None = None  # "finished": the case's `run` is a copy of a finished run
    prepare: Callable[[Path], None] | None = None  # more set-up in the case's directory
    env: dict[str, str] = field(default_factory=dict)
    prog: str = "composerun"
    # how the run directory it names must come out: "same" (byte-for-byte, nothing new),
    # "kept" (every file it had, logs may grow), "trained" (kept, but checkpoints/ may have
    # been saved to and rotated), "absent" (a new run dir must not be left)
    keep: str | None = None
    act: Callable[[subprocess.Popen, Path], None] | None = None  # what to do to the running command
    check: Callable[[Path, subprocess.CompletedProcess], list[str]] | None = None
    timeout: float = RUN_TIMEOUT
    needs: Callable[[], str | None] | None = None  # a reason the case cannot run on this machine, or None


# --- what a directory holds ------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """Every file and link under root (hidden ones too): its content's hash or its target."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def kept_problems(before: dict[str, str], root: Path, mode: str) -> list[str]:
    after = snapshot(root)
    if mode == "same":
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        return [f"{root.name}/ changed: {changed[:6]}"] if changed else []
    if mode == "absent":
        return [f"{root.name}/ was left behind: {sorted(after)[:6]}"] if root.exists() else []
    lost = []
    for rel, digest in before.items():
        if rel.startswith("torchelastic") or re.fullmatch(r"rank\d+\.log|composerun\.log|\.composerun\.lock", rel):
            continue  # logs grow, the agent adds its folders, the lock's record comes and goes
        if rel in ("summary.json", "metrics.jsonl", "plan.json") or rel.startswith(".hydra"):
            continue  # a run that started writes its records (what it writes is the case's check)
        if mode == "trained" and rel.startswith("checkpoints"):
            continue  # a run that trained saves and rotates checkpoints (the case's check says what must be there)
        if after.get(rel) != digest:
            lost.append(rel)
    return [f"lost or changed: {sorted(lost)[:6]}"] if lost else []


# --- set-ups --------------------------------------------------------------------------------------


def composerun(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT, prog: str = "composerun"
) -> subprocess.CompletedProcess:
    """`prog ARGS` in CWD, to set a case up: forked (FORKS) while the catalog runs, else as typed."""
    full = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    if not FORKS:
        return subprocess.run(
            [str(BIN / prog), *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="composerun-set-up-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = FORKS[0].start(prog, list(args), cwd, full, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess([prog, *args], code, out.read_text(), err.read_text())


def make_finished(root: Path) -> Path:
    """A finished run (unit, mesh 2, 4 steps, checkpoints at steps 2 and 4) to copy from."""
    r = composerun(*FINISHED_ARGS, "hydra.run.dir=finished", cwd=root)
    if r.returncode != 0:
        raise RuntimeError(f"the finished run failed: {r.stderr[-2000:]}")
    return root / "finished"


def ckpts(ws: Path) -> Path:
    return ws / "run" / "checkpoints"


def newest(ws: Path) -> Path:
    return ckpts(ws) / "step-00000004"


def flip_byte(path: Path, at: int = -20) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_and_keep_records(name: str) -> Callable[[Path], None]:
    """A byte flipped in the newest checkpoint's `name` (its size unchanged, so only the ranks'
    checksums find it), and the run's records as they were, kept to compare (records_kept)."""

    def prepare(ws: Path) -> None:
        flip_byte(newest(ws) / name, -40)
        for rel in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "summary.json"):
            (ws / "before" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ws / "run" / rel, ws / "before" / rel)

    return prepare


def records_kept(ws: Path, r: Any) -> list[str]:
    """A start refused in the ranks left the finished run's records byte for byte."""
    changed = [str(p.relative_to(ws / "before")) for p in sorted((ws / "before").rglob("*")) if p.is_file()
               and p.read_bytes() != (ws / "run" / p.relative_to(ws / "before")).read_bytes()]  # fmt: skip
    return [f"the finished run's records were rewritten: {changed}"] if changed else []


def edit_manifest(key: str, value: Any) -> Callable[[Path], None]:
    def prepare(ws: Path) -> None:
        path = newest(ws) / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest[key] = value
        path.write_text(json.dumps(manifest, indent=1))

    return prepare


def write(name: str, text: str) -> Callable[[Path], None]:
    def prepare(ws: Path) -> None:
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(text)

    return prepare


def data_file(ws: Path) -> None:
    (ws / "data.txt").write_text("some text that is long enough to be a data file. " * 20)


def hold_lock(ws: Path) -> None:
    """Another run, alive, holding the run directory's lock (a helper process)."""
    shutil.copytree(FIXTURES["finished"], ws / "run", symlinks=True)
    code = (
        "import sys, time; from pathlib import Path; from composerun.launch.lock import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire('composerun (the first submission)'); "
        "print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(ws / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    HELPERS.append(proc)


def dead_lock(ws: Path) -> None:
    """A lock record left by a run that was killed (its pid is gone)."""
    shutil.copytree(FIXTURES["finished"], ws / "run", symlinks=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": socket.gethostname(), "pid": dead.pid, "started": "earlier", "command": "composerun (killed)"}
    (ws / "run" / ".composerun.lock").write_text(json.dumps(record) + "\n")


USER_MODULE = """
import torch
import torch.distributed as dist
import torch.nn as nn


class WorldAware(nn.Module):
    \"\"\"A model whose forward asks the process group for its size (it works in the ranks).\"\"\"

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.l1(x) / dist.get_world_size() * dist.get_world_size()


class HostRead(nn.Module):
    \"\"\"A model whose forward reads a value to the host: it needs real values (no fake tensors).\"\"\"

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.l1(x) * (1.0 if float(x.abs().sum()) >= 0 else 2.0)


class GraphBreak(nn.Module):
    \"\"\"A model whose forward breaks torch.compile's graph: fullgraph cannot take it.\"\"\"

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)

    def forward(self, x):
        torch._dynamo.graph_break()  # (what a print or a call into a C extension would do)
        return self.l1(x)


class Greedy:
    \"\"\"A user's data source that allocates more than any machine has when it is built.\"\"\"

    def __init__(self, model, seed=0):
        self.table = torch.empty(1 << 60, dtype=torch.uint8)


class NoBias(nn.Module):
    \"\"\"Only 2-D parameters: what Muon takes.\"\"\"

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.l1(x)


class PathData:
    \"\"\"A user's data source that takes its options as **kwargs (data.path among them).\"\"\"

    def __init__(self, model, seed=0, **kwargs):
        from composerun.data import SyntheticData

        self.inner = SyntheticData(model, seed)
        self.path = kwargs["path"]
        assert open(self.path).read()

    def batch(self, indices):
        return self.inner.batch(indices)

    def loss(self, out, target):
        return self.inner.loss(out, target)
"""


def user_module(ws: Path) -> None:
    (ws / "mods").mkdir()
    (ws / "mods" / "user_stuff.py").write_text(USER_MODULE)
    data_file(ws)


def running_first_steps(ws: Path) -> None:
    """A directory a run holds, in its first seconds (no checkpoint or metrics yet)."""
    run = ws / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("the running run's config\n")
    (run / "rank0.log").write_text("the running run's log\n")
    code = (
        "import sys, time; from pathlib import Path; from composerun.launch.lock import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire('composerun (starting)'); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    HELPERS.append(proc)


def resumed_from_elsewhere(ws: Path) -> None:
    """A run started from another run's checkpoint (checkpoint.resume=src), finished."""
    shutil.copytree(FIXTURES["finished"], ws / "src", symlinks=True)
    r = composerun(*FINISHED_ARGS[:-2], "train.steps=6", "checkpoint.resume=src", "hydra.run.dir=run", cwd=ws)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])


def stray_step_files(ws: Path) -> None:
    (ckpts(ws) / "step-notes.txt").write_text("my notes on these checkpoints\n")
    os.symlink("step-00000002", ckpts(ws) / "step-99999999-link")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])  # closed again: nothing listens there


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "catalog",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def torchrun_env(drop: tuple[str, ...] = (), **changes: str) -> dict[str, str]:
    """The environment torchrun gives a rank (this one is rank 0 of 2), changed."""
    return {k: v for k, v in {**TORCHRUN_ENV, **changes}.items() if k not in drop}


# --- checks of particular cases ----------------------------------------------------------------------


def summary_of(ws: Path, run: str = "run") -> dict[str, Any]:
    return json.loads((ws / run / "summary.json").read_text())


def published(ws: Path) -> list[str]:
    root = ckpts(ws)
    return sorted(p.name for p in root.iterdir() if re.fullmatch(r"step-\d{8}", p.name) and not p.is_symlink())


def latest(ws: Path) -> str | None:
    link = ckpts(ws) / "latest"
    return os.readlink(link) if link.is_symlink() else None


def rotation_kept(ws: Path, r: Any) -> list[str]:
    out = []
    if published(ws) != ["step-00000006"]:
        out.append(f"published checkpoints: {published(ws)} (keep=1: the newest, step-00000006)")
    if latest(ws) != "step-00000006":
        out.append(f"latest -> {latest(ws)}")
    if (ckpts(ws) / "step-notes.txt").read_text() != "my notes on these checkpoints\n":
        out.append("step-notes.txt changed")
    if not (ckpts(ws) / "step-99999999-link").is_symlink():
        out.append("the user's symlink was removed")
    return out


def preempted_with_checkpoint(ws: Path, r: Any) -> list[str]:
    s = summary_of(ws)
    step = s.get("preempted_at_step")
    out = [] if s.get("status") == "preempted" else [f"summary status {s.get('status')}"]
    if not step or latest(ws) != f"step-{step:08d}":
        out.append(f"latest -> {latest(ws)}, preempted at step {step}: no checkpoint of the step it stopped at")
    return out


def preempted_once(ws: Path, r: Any) -> list[str]:
    """Every process of the group got the signal: the console says "preempted" once (rank 0
    keeps its own line in rank0.log, not on stdout too), and the step's checkpoint is there."""
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "preempted" in ln]
    out = [] if len(said) == 1 else [f"said {len(said)} times: {said}"]
    if "composerun: preempted (SIGTERM)" not in (ws / "run" / "rank0.log").read_text():
        out.append("rank0.log does not say it was preempted")
    return out + preempted_with_checkpoint(ws, r)


def completed(steps: int) -> Callable[[Path, Any], list[str]]:
    def check(ws: Path, r: Any) -> list[str]:
        s = summary_of(ws)
        return (
            []
            if s.get("status") == "ok" and s.get("steps") == steps
            else [f"summary: {s.get('status')}, {s.get('steps')} steps"]
        )

    return check


def results_kept(ws: Path, r: Any) -> list[str]:
    s = summary_of(ws)
    return [] if s.get("final_loss") is not None and s.get("status") == "ok" else [f"results lost: {s}"]


def sweep_report_lists_failed(ws: Path, r: Any) -> list[str]:
    rows = list((ws / "sweep" / "summary.csv").read_text().splitlines())
    failed = [row for row in rows if ",failed," in row and "train.steps" in row]
    return [] if len(rows) == 3 and failed else [f"summary.csv rows: {rows}"]


def sweep_results_kept(ws: Path, r: Any) -> list[str]:
    rows = (ws / "sweep" / "summary.csv").read_text().splitlines()[1:]
    losses = [row.split(",")[6] for row in rows]
    return [] if len(rows) == 2 and all(losses) else [f"summary.csv rows: {rows}"]


def _went_back(ws: Path, r: Any) -> list[str]:
    aside = sorted((ws / "run").glob("replaced-*"))
    s = summary_of(ws)
    out = [] if s.get("status") == "ok" and s.get("start_step") == 2 and s.get("steps") == 4 else [f"summary {s}"]
    if len(aside) != 1 or not (aside[0] / "checkpoints" / "step-00000004" / "manifest.json").is_file():
        out.append(f"the later checkpoints were not kept aside: {aside}")
    return out


def _summary_kept(ws: Path, r: Any) -> list[str]:
    s = summary_of(ws)
    out = [] if s.get("verify", {}).get("ok") else [f"no verification report: {s.get('verify')}"]
    for key in ("measured_bytes_per_rank", "time_to_first_step_s", "final_loss", "job_wall_s"):
        if s.get(key) is None:
            out.append(f"summary.json lost {key}")
    return out


def _moved_aside(ws: Path) -> list[str]:
    aside = sorted((ws / "run").glob("replaced-*"))
    if len(aside) != 1 or not (aside[0] / "checkpoints" / "step-00000004" / "manifest.json").is_file():
        return [f"the earlier run was not moved aside whole: {aside}"]
    return completed(4)(ws, None)


def disk_full_left(ws: Path, r: Any) -> list[str]:
    out = []
    run = ws / "full" / "run"
    if list(run.rglob("*.json.tmp")):
        out.append(f"half-written files: {list(run.rglob('*.json.tmp'))}")
    if latest(ws / "full") != "step-00000002":
        out.append(f"latest -> {latest(ws / 'full')}, not the last complete checkpoint")
    return out


def no_hydra_log(ws: Path, r: Any) -> list[str]:
    """Hydra's own multi-line ERROR log (of a failed import, on stdout) is kept out."""
    return ["Hydra's error log on stdout"] if "hydra.utils" in r.stdout + r.stderr else []


def nothing_written(ws: Path, r: Any) -> list[str]:
    """The command wrote nothing where it ran (Hydra would have taken it as the run directory)."""
    left = sorted(p.name for p in ws.iterdir() if p.name not in ("stdout", "stderr"))
    return [f"written where it ran: {left}"] if left else []


def export_ok(ws: Path, r: Any) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(ws / "run" / "export" / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    return [] if meta.get("format") == "pt" else [f"safetensors metadata {meta}"]


def mounted_full(ws: Path) -> None:
    """A 600 KiB file system: room for the first checkpoint of a dim-96 unit model, not the second."""
    (ws / "full").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(ws / "full")], check=True)


def can_mount() -> str | None:
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True)
        if r.returncode != 0:
            return "cannot mount a small file system here (not root?)"
        subprocess.run(["umount", d], check=False)
    return None


# --- acts on a running command -------------------------------------------------------------------


def when_logged(step: int, then: Callable[[subprocess.Popen], None]) -> Callable[[subprocess.Popen, Path], None]:
    def act(proc: subprocess.Popen, ws: Path) -> None:
        metrics = ws / "run" / "metrics.jsonl"
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) > step:
                then(proc)
                return
            time.sleep(0.02)

    act.after_start = True  # type: ignore[attr-defined]  (see `forked`)
    return act


def to_launcher(sig: int) -> Callable[[subprocess.Popen], None]:
    return lambda proc: os.kill(proc.pid, sig)


def to_group(sig: int) -> Callable[[subprocess.Popen], None]:
    return lambda proc: os.killpg(proc.pid, sig)


def kill_launcher(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)


def ranks_gone(ws: Path, r: Any) -> list[str]:
    """After the launcher was SIGKILLed: nothing of its process group is left (the ranks
    stopped by themselves), and the step they stopped at was checkpointed."""
    out = []
    deadline = time.monotonic() + GONE_WITHIN
    while (left := group_members(r.pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        out.append(f"processes left {GONE_WITHIN} s after the launcher died: {left}")
    name = latest(ws)
    s = summary_of(ws)
    if not name or s.get("status") != "preempted" or name != f"step-{s.get('preempted_at_step'):08d}":
        out.append(f"latest -> {name}, summary {s.get('status')} at {s.get('preempted_at_step')}")
    return out


# The ranks of a SIGKILLed launcher save and exit in seconds; the bound says "promptly, no
# hang" with room for a loaded machine.
GONE_WITHIN = 120


def group_members(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def during_plan(proc: subprocess.Popen, ws: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (ws / "plan").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)


during_plan.after_start = True  # type: ignore[attr-defined]  (the plan's folder is made once the imports are done)


def after(seconds: float, sig: int) -> Callable[[subprocess.Popen, Path], None]:
    def act(proc: subprocess.Popen, ws: Path) -> None:
        time.sleep(seconds)
        os.killpg(proc.pid, sig)

    return act


def after_cpu(seconds: float, sig: int) -> Callable[[subprocess.Popen, Path], None]:
    """`sig` once the command has used `seconds` of CPU: a point in its own start-up whatever the
    machine's load (a wall-clock delay on a busy machine can land before the interpreter has
    run a line of composerun, where every Python program prints a KeyboardInterrupt traceback)."""
    tick = os.sysconf("SC_CLK_TCK")

    def act(proc: subprocess.Popen, ws: Path) -> None:
        stat = Path(f"/proc/{proc.pid}/stat")
        while proc.poll() is None:
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                break
            if (int(fields[11]) + int(fields[12])) / tick >= seconds:  # utime + stime
                break
            time.sleep(0.005)
        os.killpg(proc.pid, sig)

    return act


# --- the catalog ---------------------------------------------------------------------------------

R = ("hydra.run.dir=run",)
TWO = ("mesh=2",)
LLAMA = ("+model=llama3_debug", "model.dim=64", "model.n_layers=2", "model.seq_len=16")  # a small Llama
FSDP_ROOT = "{match: '<root>', api: fully_shard}"
COMPOSITE2 = ("+model=composite", "mesh=2")  # the model and mesh of the policy cases r26-r33


def cases() -> list[Case]:
    # fmt: off
    C = Case
    many = 4 * cores() + 1
    cfg = [
        C("c01", "config", "negative steps", (*UNIT, "train.steps=-1", *R), 2, r"train\.steps=-1", keep="absent"),
        C("c02", "config", "negative weight decay", (*UNIT, "optim.weight_decay=-5", *R), 2, r"optim\.weight_decay", keep="absent"),
        C("c03", "config", "negative grad clip", (*UNIT, "optim.grad_clip=-1", *R), 2, r"optim\.grad_clip=-1", keep="absent"),
        C("c04", "config", "min_lr_ratio above 1", (*UNIT, "optim.min_lr_ratio=1.5", *R), 2, r"optim\.min_lr_ratio", keep="absent"),
        C("c05", "config", "zero learning rate", (*UNIT, "optim.lr=0", *R), 2, r"optim\.lr=0", keep="absent"),
        C("c06", "config", "negative seed", (*UNIT, "train.seed=-1", *R), 2, r"train\.seed=-1", keep="absent"),
        C("c07", "config", "data seed too large", (*UNIT, "data.seed=99999999999999999", *R), 2, r"data\.seed", keep="absent"),
        C("c08", "config", "a key added that nothing reads", (*UNIT, "+train.stepz=2", *R), 2, r"did you mean train\.steps", keep="absent"),
        C("c09", "config", "negative width", ("+model=unit", "model.dim=-4", *R), 2, r"model\.dim=-4", keep="absent"),
        C("c10", "config", "unknown model", ("+model=nosuch", *R), 2, "unknown model 'nosuch'", keep="absent"),
        C("c11", "config", "no model", R, 2, "no model chosen", keep="absent"),
        C("c12", "config", "zero micro-batches", (*UNIT, "train.grad_accum=0", *R), 2, r"train\.grad_accum=0", keep="absent"),
        C("c13", "config", "batch not divisible", (*UNIT, *TWO, "data.batch_size=7", *R), 2, r"data\.batch_size=7", keep="absent"),
        C("c14", "config", "negative monitor interval", (*UNIT, "launch.monitor_interval=-1", *R), 2, r"launch\.monitor_interval", keep="absent"),
        C("c15", "config", "Adam betas out of range", (*UNIT, "+optim.kwargs.betas=[2,3]", *R), 2, r"optim\.kwargs\.betas", keep="absent"),
        C("c16", "config", "unknown optimizer class", (*UNIT, "optim._target_=torch.optim.Nope", *R), 2, r"optim\._target_=torch\.optim\.Nope", keep="absent"),
        C("c17", "config", "unimportable model", (*UNIT, "model._target_=nosuch.Mod", *R), 2, r"^composerun: error: model\._target_=nosuch\.Mod: cannot import it: ModuleNotFoundError: No module named 'nosuch'$", keep="absent", check=no_hydra_log),
        C("c40", "config", "a Hugging Face export of a model that has no Hugging Face equivalent", ("+model=composite", "mesh=2", "checkpoint.export=hf", *R), 2, r"checkpoint\.export=hf.*no Hugging Face equivalent", keep="absent"),
        C("c39", "config", "a model class its module does not have", (*UNIT, "model._target_=torch.nn.Nope", *R), 2, r"^composerun: error: model\._target_=torch\.nn\.Nope: module torch\.nn has no Nope$", keep="absent", check=no_hydra_log),
        C("c18", "config", "regression data into a token model", ("+model=transformer", "model.task=regression", *R), 2, r"cannot take the batches.*model\.task", keep="absent"),
        C("c29", "config", "token data into a regression model", (*UNIT, "model.task=tokens", *R), 2, r"model\.vocab_size", keep="absent"),
        C("c19", "config", "data.path to a source that reads none", (*UNIT, "data.path=data.txt", *R), 2, r"data\.path=data\.txt: .*reads no file", prepare=data_file, keep="absent"),
        C("c20", "config", "unknown optimizer argument", (*UNIT, "+optim.kwargs.nope=1", *R), 2, r"optim\._target_.*nope", keep="absent"),
        C("c21", "config", "keep no checkpoint", (*UNIT, "checkpoint.keep=0", *R), 2, r"checkpoint\.keep=0", keep="absent"),
        C("c22", "config", "negative warmup", (*UNIT, "optim.warmup_steps=-1", *R), 2, r"optim\.warmup_steps", keep="absent"),
        C("c23", "config", "log never", (*UNIT, "train.log_every=0", *R), 2, r"train\.log_every=0", keep="absent"),
        C("c24", "config", "negative interval", (*UNIT, "checkpoint.every=-1", *R), 2, r"checkpoint\.every=-1", keep="absent"),
        C("c25", "config", "negative shutdown timeout", (*UNIT, "launch.shutdown_timeout=-1", *R), 2, r"launch\.shutdown_timeout", keep="absent"),
        C("c26", "config", "steps not a number", (*UNIT, "train.steps=abc", *R), 2, r"train\.steps", keep="absent"),
        C("c27", "config", "unknown device", (*UNIT, "mesh.device=tpu", *R), 2, r"mesh\.device", keep="absent"),
        C("c28", "config", "a misspelt group key", (*UNIT, "trian.steps=3", *R), 2, r"trian: no such key in the config; did you mean train\?", keep="absent"),
        C("c30", "config", "a plan for no memory", (*UNIT, "plan=true", "plan.memory_gib=0", *R), 2, r"plan\.memory_gib=0\.0: must be a positive number", keep="absent"),
        C("c31", "config", "a plan for a device composerun does not know", (*UNIT, "plan=true", "plan.device=H999", *R), 2, r"plan\.device=H999: composerun knows H100, H100-PCIe, .*; or describe it: .*, or give plan\.memory_gib", keep="absent"),
        C("c34", "config", "a device map with a key it does not take", (*UNIT, "plan=true", "plan.device={base: H100, nvlink: 900}", *R), 2, r"plan\.device\.nvlink: no such key in a device map; it takes name, base, memory_gib", keep="absent"),
        C("c35", "config", "a device map with a negative peak", (*UNIT, "plan=true", "plan.device={base: H100, bf16_tflops: -5}", *R), 2, r"plan\.device\.bf16_tflops=-5: must be a positive number \(TFLOP/s", keep="absent"),
        C("c36", "config", "a device map without a base and a figure missing", (*UNIT, "plan=true", "plan.device={name: X, memory_gib: 80}", *R), 2, r"plan\.device\.bf16_tflops: missing .*or give base: H100", keep="absent"),
        C("c37", "config", "a device map on an unknown base", (*UNIT, "plan=true", "plan.device={base: GH100, memory_gib: 90}", *R), 2, r"plan\.device\.base=GH100: composerun knows H100, ", keep="absent"),
        C("c38", "config", "a learning rate that is not a number", (*UNIT, "optim.lr=abc", *R), 2, r"optim\.lr", keep="absent"),
        C("c32", "config", "a plan where even a micro-batch of 1 does not fit", ("+model=llama3_8b", "sharding=none", "plan=true", "plan.memory_gib=10", "data.batch_size=1", "data.seq_len=512", *R), 2, r"does not fit even with a micro-batch of 1: rank 0 needs \d+\.\d+ GiB of the 10\.0 GiB", keep="absent"),
        C("c33", "config", "a plan of a model fake tensors cannot run", ("+model=unit", "model._target_=user_stuff.HostRead", "model.dim=16", "plan=true", *R), 2, r"model unit \(user_stuff\.HostRead\): its forward cannot run on fake tensors .*aten\._local_scalar_dense", env={"PYTHONPATH": "mods"}, prepare=user_module, keep="absent"),
        C("c41", "config", "a negative OpenMP thread count", (*UNIT, *TWO, "launch.omp_threads=-3", *R), 2, r"launch\.omp_threads=-3: must be 1 or more", keep="absent"),
        C("c42", "config", "an optimizer argument of the wrong type", (*UNIT, "+optim.kwargs.betas=oops", *R), 2, r"^composerun: error: optim\.kwargs\.betas=oops: ", keep="absent"),
        C("c43", "config", "an interpolation of a key that does not exist", (*UNIT, "train.steps=${nosuch}", *R), 2, r"train\.steps=\$\{nosuch\}: Interpolation key 'nosuch' not found", keep="absent"),
        C("c44", "config", "a space in hydra.run.dir, unquoted", (*UNIT, "hydra.run.dir=my", "run"), 2, r"'run' is not key=value: .*quote it: 'hydra\.run\.dir=my run'", keep="absent"),
        C("c45", "config", "a model too large for the machine", ("+model=unit", "model.dim=100000000", *R), 2, r"model unit: its parameters alone take [\d,.]+ GiB even fully sharded over mesh=1, more than this machine's", keep="absent"),
        C("c46", "config", "a profiled span that ends before it starts", (*UNIT, "train.steps=5", "profile.steps=[3,2]", *R), 2, r"profile\.steps=\[3,2\]: give \[A,B\], the first and last step to trace, with 1 <= A <= B <= train\.steps \(5\)", keep="absent"),
        C("c47", "config", "a profiled span past the last step", (*UNIT, "train.steps=5", "profile.steps=[4,9]", *R), 2, r"profile\.steps=\[4,9\]: give \[A,B\]", keep="absent"),
        C("c48", "config", "a collective timeout of no time", (*UNIT, "launch.collective_timeout=0", *R), 2, r"launch\.collective_timeout=0(\.0)?: must be more than 0 seconds", keep="absent"),
        C("c49", "config", "a negative flight recorder", (*UNIT, "profile.flight_recorder=-1", *R), 2, r"profile\.flight_recorder=-1: the collectives to keep per rank, 0 \(off\) or more", keep="absent"),
    ]
    mesh = [
        C("m01", "mesh", "a mesh Hydra reads as an int", (*UNIT, "mesh=2_4", *R), 2, "unknown mesh '2_4'", keep="absent"),
        C("m02", "mesh", "a zero-rank mesh", (*UNIT, "mesh=0", *R), 2, r"mesh\.shape=\[0\]", keep="absent"),
        C("m03", "mesh", "more ranks than the machine takes", (*UNIT, f'mesh={many}', f'data.batch_size={many}', *R), 2, r"launch\.oversubscribe=true", keep="absent"),
        C("m04", "mesh", "nccl without a GPU", (*UNIT, "mesh.backend=nccl", *R), 2, r"mesh\.backend=nccl", keep="absent", needs=lambda: "a GPU is visible" if _cuda() else None),
        C("m05", "mesh", "cuda without a GPU", (*UNIT, "mesh.device=cuda", *R), 2, r"mesh\.device=cuda", keep="absent", needs=lambda: "a GPU is visible" if _cuda() else None),
        C("m06", "mesh", "dim names that do not fit", (*UNIT, "mesh=2x2", "mesh.dim_names=[a]", *R), 2, r"mesh\.dim_names", keep="absent"),
        C("m07", "mesh", "a plan too big", (*UNIT, "mesh=100000x100000", "plan=true", *R), 2, r"^composerun: error: mesh\.shape=\[100000, 100000\]: 10,000,000,000 ranks; plan=true plans meshes of at most 1,048,576 ranks$", keep="absent"),
        C("m08", "mesh", "a 3-D mesh without a policy for it", (*UNIT, "mesh=2x2x2", "sharding=hsdp", "data.batch_size=8", *R), 2, "mesh_dims", keep="absent"),
        C("m09", "mesh", "a mesh spelt wrong", (*UNIT, "mesh=3y3", *R), 2, "unknown mesh '3y3'", keep="absent"),
        C("m10", "mesh", "a zero in mesh.shape", (*UNIT, "mesh.shape=[0,2]", *R), 2, r"mesh\.shape=\[0, 2\]", keep="absent"),
        C("m11", "mesh", "a plan on a zero-rank mesh", (*UNIT, "mesh=8x0", "plan=true", *R), 2, r"mesh\.shape=\[8, 0\]: every dimension", keep="absent"),
    ]
    rules = [
        C("r01", "rules", "a rule without api", (*UNIT, "sharding.rules=[{match: l1}]", *R), 2, r"sharding\.rules\.0: no api", keep="absent"),
        C("r02", "rules", "a rule that matches nothing", (*UNIT, "sharding.rules.0.match=nothere", *R), 2, "matches no module", keep="absent"),
        C("r03", "rules", "HSDP on a 1-D mesh", (*UNIT, "sharding=hsdp", *TWO, *R), 2, "HSDP needs a 2-D mesh", keep="absent"),
        C("r04", "rules", "no data-parallel rule on 2 ranks", (*UNIT, "sharding=none", *TWO, *R), 2, "unsynchronised copies", keep="absent"),
        C("r05", "rules", "a rule index out of range", (*UNIT, "sharding.rules.7.every=1", *R), 2, r"sharding\.rules\.7: there is no rule 7", keep="absent"),
        C("r06", "rules", "a mesh dim that does not exist", (*UNIT, "mesh=2x2", "sharding=hsdp", "sharding.rules.0.mesh_dims=[replicate,nodim]", *R), 2, "no dim 'nodim'", keep="absent"),
        C("r07", "rules", "negative prefetch", (*UNIT, "sharding.prefetch_forward=-1", *R), 2, r"sharding\.prefetch_forward", keep="absent"),
        C("r08", "rules", "a class that does not exist", (*UNIT, "sharding.rules=[{class_name: Nope, api: fully_shard}]", *R), 2, "no module of class 'Nope'", keep="absent"),
        C("r09", "rules", "every 0th module", (*UNIT, "sharding.rules.0.every=0", *R), 2, "every=0", keep="absent"),
        C("r10", "rules", "an unknown api", (*UNIT, "sharding.rules.0.api=shard_it", *R), 2, "api", keep="absent"),
        C("r11", "rules", "parallelize on a mesh without a tp dim", (*LLAMA, *TWO, f"sharding.rules=[{{match: '<root>', api: parallelize}}, {FSDP_ROOT}]", *R), 2, r"parallelize runs over the mesh dim `tp`, and the mesh's dims are \['shard'\]", keep="absent"),
        C("r12", "rules", "a tensor-parallel policy on a 1-D mesh", (*LLAMA, "mesh=4", "sharding=fsdp_tp", *R), 2, r"sharding=fsdp_tp names the dims of a 2-D mesh \['shard', 'tp'\]", keep="absent"),
        C("r13", "rules", "a TP style naming no submodule", (*LLAMA, *TWO, "sharding=tp", "sharding.rules.0.styles={self_attn.nope: colwise}", *R), 2, r"'self_attn\.nope' names no submodule of 'layers\.0'", keep="absent"),
        C("r14", "rules", "colwise on a norm", (*LLAMA, *TWO, "sharding=tp", "sharding.rules.0.styles={input_layernorm: colwise}", *R), 2, r"colwise splits a Linear's or an Embedding's weight.*RMSNorm", keep="absent"),
        C("r15", "rules", "heads not divisible by the TP degree", (*LLAMA, "mesh=4", "sharding=tp", *R), 2, r"n_kv_heads=2, which 4 tensor-parallel ranks cannot split", keep="absent"),
        C("r16", "rules", "float8 on a CPU", (*LLAMA, *TWO, "sharding=fsdp_blocks_float8", *R), 2, r"api: float8 .*(CUDA GPU of compute capability 8\.9|needs torchao)", keep="absent"),
        C("r17", "rules", "AC mode budget without compile", (*LLAMA, "sharding=fsdp_blocks_sac", "sharding.rules.0.mode=budget", "sharding.rules.0.memory_budget=0.5", *R), 2, r"mode budget is the compiler's .*not compiled", keep="absent"),
        C("r18", "rules", "a memory budget above 1", (*LLAMA, "sharding=fsdp_blocks_sac", "sharding.rules.0.mode=budget", "sharding.rules.0.memory_budget=1.5", *R), 2, r"memory_budget=1\.5: .*between 0", keep="absent"),
        C("r19", "rules", "a compile mode torch does not know", (*LLAMA, "sharding=fsdp_blocks_compile", "sharding.rules.0.mode=fastest", *R), 2, r"mode=fastest: torch\.compile's modes are", keep="absent"),
        C("r20", "rules", "an inductor option torch does not know", (*LLAMA, "sharding=fsdp_blocks_compile", "sharding.rules.0.compile_options={no_such_knob: 1}", *R), 2, r"compile_options\.no_such_knob: not an option of inductor", keep="absent"),
        C("r21", "rules", "an option of another api", (*UNIT, "sharding.rules.0.loss_parallel=true", *R), 2, r"loss_parallel: an option of api parallelize, not of fully_shard", keep="absent"),
        C("r22", "rules", "a selective AC op torch does not know", (*LLAMA, "sharding=fsdp_blocks_sac", "sharding.rules.0.save_ops=[aten.nope]", *R), 2, r"'aten\.nope' is no op torch knows", keep="absent"),
        C("r23", "rules", "a module torch.compile cannot take whole", ("+model=unit", "model._target_=user_stuff.GraphBreak", "model.dim=16", "sharding.rules=[{match: '<root>', api: compile, fullgraph: true}, {match: '<root>', api: fully_shard}]", "train.steps=2", *R), 2, r"sharding\.rules\[0\] \(match='<root>'\): module '<root>': torch\.compile failed: ", env={"PYTHONPATH": "mods"}, prepare=user_module, keep="kept"),
        C("r24", "rules", "compile.fallback=eager runs it uncompiled", ("+model=unit", "model._target_=user_stuff.GraphBreak", "model.dim=16", "sharding.rules=[{match: '<root>', api: compile, fullgraph: true}, {match: '<root>', api: fully_shard}]", "compile.fallback=eager", "train.steps=2", *R), 0, env={"PYTHONPATH": "mods"}, prepare=user_module, check=completed(2)),
        C("r25", "rules", "bf16 under tensor parallelism alone", (*LLAMA, *TWO, "sharding=tp", "sharding.param_dtype=bfloat16", *R), 2, r"sharding\.param_dtype=bfloat16: mixed precision is fully_shard's and replicate's, and sharding=tp has neither.*or remove sharding\.param_dtype", keep="absent"),
        C("r26", "rules", "an unknown api in a rule list", (*COMPOSITE2, 'sharding.rules=[{match: "*", api: shard_it}]', *R), 2, re.escape("sharding.rules: api: Invalid value 'shard_it'"), keep="absent"),
        C("r27", "rules", "a glob that matches nothing", (*COMPOSITE2, "sharding.rules=[{match: nope, api: fully_shard}]", *R), 2, re.escape("sharding.rules[0] (match='nope') matches no module"), keep="absent"),
        C("r28", "rules", "a class the model does not have", (*COMPOSITE2, "sharding.rules=[{class_name: Nope, api: fully_shard}]", *R), 2, re.escape("sharding.rules[0] (class_name='Nope'): CompositeModel has no module of class 'Nope'"), keep="absent"),
        C("r29", "rules", "an api given twice to a module", (*COMPOSITE2, 'sharding.rules=[{match: "*", api: fully_shard}, {match: l1, api: fully_shard}]', *R), 2, re.escape("sharding.rules[1] (match='l1'): module 'l1' is already given fully_shard by sharding.rules[0]"), keep="absent"),
        C("r30", "rules", "a rule on a mesh dim a 1-D mesh lacks", (*COMPOSITE2, 'sharding.rules=[{match: "<root>", api: fully_shard, mesh_dims: [tp]}]', *R), 2, re.escape("sharding.rules[0] (match='<root>').mesh_dims=['tp']: the mesh has no dim 'tp'"), keep="absent"),
        C("r31", "rules", "hsdp on a 1-D mesh (composite)", (*COMPOSITE2, "sharding=hsdp", *R), 2, re.escape("HSDP needs a 2-D mesh such as mesh=2x2"), keep="absent"),
        C("r32", "rules", "sharding=none on several ranks (composite)", (*COMPOSITE2, "sharding=none", *R), 2, re.escape("sharding=none has no fully_shard/replicate rule, so 2 data-parallel replicas"), keep="absent"),
        C("r33", "rules", "a rule key that does not exist", (*COMPOSITE2, 'sharding.rules=[{match: "*", api: fully_shard, colour: red}]', *R), 2, "unknown key 'colour'", keep="absent"),
    ]
    fin = dict(given="finished", keep="same")
    ck = [
        C("k01", "checkpoints", "resume a path that does not exist", (*UNIT, "checkpoint.resume=/nowhere/step-00000004", *R), 2, r"^composerun: error: checkpoint\.resume=/nowhere/step-00000004: no such checkpoint directory; use auto, never, a checkpoint \(RUN_DIR/checkpoints/step-N\) or a run directory$", keep="absent"),
        C("k02", "checkpoints", "resume another model", ("+model=composite", "model.dim=16", "checkpoint.resume=run", "hydra.run.dir=new"), 2, "holds another model", given="finished", keep="same"),
        C("k03", "checkpoints", "resume another width", ("+model=unit", "model.dim=32", "checkpoint.resume=run", "hydra.run.dir=new"), 2, "another size of this model", given="finished", keep="same"),
        C("k04", "checkpoints", "train.steps below the checkpoint's step", (*FINISHED_ARGS[:-2], "train.steps=2", *R), 2, r"train\.steps=2 is below step 4", **fin),
        C("k05", "checkpoints", "a truncated file in the newest checkpoint", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, r"truncated or damaged.*checkpoint\.resume=PATH", prepare=lambda ws: os.truncate(newest(ws) / "__0_0.distcp", 100), **fin),
        C("k06", "checkpoints", "tampered metadata", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, r"\.metadata: checksum mismatch", prepare=lambda ws: flip_byte(newest(ws) / ".metadata"), **fin),
        C("k07", "checkpoints", "a tampered data file (same size)", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 1, r"__1_0\.distcp: checksum mismatch", prepare=flip_and_keep_records("__1_0.distcp"), given="finished", keep="kept", check=records_kept),
        C("k36", "checkpoints", "a tampered data file, resumed on one rank", (*UNIT, "mesh=1", "train.steps=6", *R), 1, r"__0_0\.distcp: checksum mismatch", prepare=flip_and_keep_records("__0_0.distcp"), given="finished", keep="kept", check=records_kept),
        C("k08", "checkpoints", "the newest checkpoint lost its manifest", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, r"step-00000004: no manifest\.json", prepare=lambda ws: (newest(ws) / "manifest.json").unlink(), **fin),
        C("k09", "checkpoints", "the newest step folder is a broken symlink", (*FINISHED_ARGS[:-2], "train.steps=8", *R), 2, "step-00000006: a broken symlink", prepare=lambda ws: os.symlink("/nowhere", ckpts(ws) / "step-00000006"), **fin),
        C("k10", "checkpoints", "a hand-edited manifest step", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, "says step 3 but the folder is step-00000004", prepare=edit_manifest("step", 3), **fin),
        C("k11", "checkpoints", "a hand-edited manifest world size", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, "mesh 2 is 2 ranks but world_size says 4", prepare=edit_manifest("world_size", 4), **fin),
        C("k12", "checkpoints", "a hand-edited manifest world size and mesh", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, "holds the state of 2 ranks", prepare=lambda ws: (edit_manifest("world_size", 4)(ws), edit_manifest("mesh", "4")(ws)), **fin),
        C("k13", "checkpoints", "strays in checkpoints/ and keep=1", (*FINISHED_ARGS[:-2], "train.steps=6", "checkpoint.keep=1", *R), 0, given="finished", prepare=stray_step_files, keep="trained", check=rotation_kept),
        C("k14", "checkpoints", "resume=never over checkpoints", (*FINISHED_ARGS, "checkpoint.resume=never", *R), 2, r"checkpoint\.start_over=true", **fin),
        C("k15", "checkpoints", "init_from a missing file", (*UNIT, "checkpoint.init_from=nope.safetensors", *R), 2, r"init_from=nope\.safetensors: no such file", keep="absent"),
        C("k16", "checkpoints", "init_from a junk file", (*UNIT, "checkpoint.init_from=junk.safetensors", *R), 2, "not a readable safetensors file", prepare=write("junk.safetensors", "not a tensor"), keep="absent"),
        C("k17", "checkpoints", "init_from another model's weights", ("+model=composite", "model.dim=16", "checkpoint.init_from=run/export/model.safetensors", "hydra.run.dir=new"), 2, "does not fit the model", given="finished", prepare=lambda ws: _export(ws), keep="same"),
        C("k18", "checkpoints", "init_from a folder", (*UNIT, "checkpoint.init_from=.", *R), 2, r"init_from=\.: a directory", keep="absent"),
        C("k19", "checkpoints", "the same command again on a finished run", (*FINISHED_ARGS, *R), 0, **fin),
        C("k20", "checkpoints", "resume from a file", (*UNIT, "checkpoint.resume=data.txt", *R), 2, r"checkpoint\.resume=data\.txt", prepare=data_file, keep="absent"),
        C("k21", "checkpoints", "checkpoints/ is a file", (*UNIT, *TWO, *R), 2, r"^composerun: error: .*checkpoints is a file where the run's checkpoints go: move it away, or choose another hydra\.run\.dir$", prepare=write("run/checkpoints", "in the way"), keep="same"),
        C("k22", "checkpoints", "start over without checkpoints on a finished run", (*UNIT, *TWO, "checkpoint=none", *R), 2, "holds checkpoints of an earlier run", **fin),
        C("k23", "checkpoints", "export a finished run without training (train.steps=0)", (*UNIT, "train.steps=0", "checkpoint.export=safetensors", *R), 0, given="finished", keep="kept", check=export_ok),
        C("k24", "checkpoints", "negative steps in a finished run's directory", (*FINISHED_ARGS[:-2], "train.steps=-1", *R), 2, r"train\.steps=-1", **fin),
        C("k25", "checkpoints", "a bad weight decay in a finished run's directory", (*FINISHED_ARGS, "optim.weight_decay=-5", *R), 2, r"optim\.weight_decay", **fin),
        C("k26", "checkpoints", "start over explicitly (checkpoint.start_over=true)", (*FINISHED_ARGS, "checkpoint.resume=never", "checkpoint.start_over=true", *R), 0, given="finished", check=lambda ws, r: _moved_aside(ws)),
        C("k27", "checkpoints", "a run stopped before its first checkpoint, run again", (*UNIT, "train.steps=3", *R), 0, prepare=write("run/summary.json", '{"status": "preempted", "preempted_at_step": null, "checkpoint": null}'), check=lambda ws, r: completed(3)(ws, r)),
        C("k28", "checkpoints", "a resume with another learning rate", (*FINISHED_ARGS[:-2], "train.steps=6", "optim.lr=3e-3", *R), 0, given="finished", keep="trained", check=lambda ws, r: [] if re.search(r"resuming \S+step-00000004 with a changed config: .*optim\.lr 0\.001 -> 0\.003; train\.steps 4 -> 6", r.stdout) else [f"no line saying what changed: {r.stdout[-300:]!r}"]),
        C("k29", "checkpoints", "going back to an older checkpoint of the run", (*FINISHED_ARGS[:-2], "train.steps=4", "checkpoint.resume=run/checkpoints/step-00000002", *R), 2, r"go back to an older one", **fin),
        C("k30", "checkpoints", "going back, with checkpoint.start_over=true", (*FINISHED_ARGS[:-2], "train.steps=4", "checkpoint.resume=run/checkpoints/step-00000002", "checkpoint.start_over=true", *R), 0, given="finished", check=_went_back),
        C("k31", "checkpoints", "train.steps=0 with nothing to load", (*UNIT, "train.steps=0", "checkpoint.export=safetensors", *R), 2, r"train\.steps=0 trains nothing", keep="absent"),
        C("k32", "checkpoints", "verify a finished run without training", (*UNIT, *TWO, "train.steps=0", "checkpoint.verify=true", *R), 0, given="finished", keep="kept", check=_summary_kept),
        C("k33", "checkpoints", "the same command again after starting from another run", (*FINISHED_ARGS[:-2], "train.steps=6", "checkpoint.resume=src", *R), 0, prepare=resumed_from_elsewhere, keep="same", check=lambda ws, r: [] if "already trained 6 steps" in r.stdout else [f"not reported as done: {r.stdout[-300:]!r}"]),
        C("k34", "checkpoints", "a user model that asks the process group in its forward", ("+model=unit", "model._target_=user_stuff.WorldAware", "model.dim=16", *TWO, "train.steps=2", *R), 0, env={"PYTHONPATH": "mods"}, prepare=user_module, check=completed(2)),
        C("k35", "checkpoints", "Muon on a model of 2-D parameters", ("+model=unit", "model._target_=user_stuff.NoBias", "model.dim=16", "optim._target_=torch.optim.Muon", "~optim.kwargs.fused", "optim.lr=0.01", "train.steps=2", *R), 0, env={"PYTHONPATH": "mods"}, prepare=user_module, check=completed(2)),
    ]
    data = [
        C("d01", "data", "an empty text file", ("+model=transformer", "data=text", "data.path=empty.txt", *R), 2, r"data\.path=empty\.txt", prepare=write("empty.txt", ""), keep="absent"),
        C("d02", "data", "a text shorter than a sample", ("+model=transformer", "data=text", "data.path=short.txt", *R), 2, r"fewer than seq_len\+1=\d+ bytes", prepare=write("short.txt", "tiny"), keep="absent"),
        C("d03", "data", "text into a regression model", (*UNIT, "data=text", *R), 2, r"model\.vocab_size|cannot take the batches", keep="absent"),
        C("d04", "data", "data.path a folder", ("+model=transformer", "data=text", "data.path=.", *R), 2, r"data\.path=\.", keep="absent"),
        C("d05", "data", "data.path missing", ("+model=transformer", "data=text", "data.path=missing.txt", *R), 2, r"data\.path=missing\.txt: no such file", keep="absent"),
        C("d06", "data", "a data source taking data.path through **kwargs", (*UNIT, "data._target_=user_stuff.PathData", "data.path=data.txt", "train.steps=2", *R), 0, env={"PYTHONPATH": "mods"}, prepare=user_module, check=completed(2)),
        C("d07", "data", "a data source that cannot allocate what it builds", (*UNIT, "data._target_=user_stuff.Greedy", *R), 1, r"out of memory before any rank started \(RuntimeError: DefaultCPUAllocator: can't allocate memory", env={"PYTHONPATH": os.pathsep.join(["mods", *filter(None, [os.environ.get("PYTHONPATH")])])}, prepare=user_module, keep="absent"),
    ]
    sweeps = [
        C("s01", "sweeps", "a job that fails its checks", ("-m", *UNIT, "train.steps=2,-1", "hydra.sweep.dir=sweep"), 2, r"train\.steps=-1", check=sweep_report_lists_failed),
        C("s02", "sweeps", "hydra.sweep.dir names a file", ("-m", *UNIT, "train.steps=1,2", "hydra.sweep.dir=afile/sweep"), 2, r"hydra\.sweep\.dir", prepare=write("afile", "x")),
        C("s03", "sweeps", "a value that is not a choice", ("-m", "+model=unit,nosuch", "hydra.sweep.dir=sweep"), 2, "unknown model 'nosuch'.*no job of the sweep was started", check=lambda ws, r: ["sweep dir left"] if (ws / "sweep").exists() else []),
        C("s04", "sweeps", "a finished sweep run again", ("-m", *UNIT, "train.steps=2,3", "hydra.sweep.dir=sweep"), 0, prepare=lambda ws: _sweep(ws, "train.steps=2,3"), check=sweep_results_kept),
        C("s05", "sweeps", "a finished sweep of checkpoint=none jobs run again", ("-m", *UNIT, "checkpoint=none", "train.steps=2,3", "hydra.sweep.dir=sweep"), 2, r"checkpoint\.start_over=true", prepare=lambda ws: _sweep(ws, "train.steps=2,3", "checkpoint=none"), keep="same"),
    ]
    env = [
        C("e01", "environment", "torchrun environment without MASTER_ADDR", (*UNIT, *TWO, *R), 2, "MASTER_ADDR is not set", env=torchrun_env(drop=("MASTER_ADDR",)), keep="absent"),
        C("e02", "environment", "a RANK that is not a number", (*UNIT, *TWO, *R), 2, "RANK='abc' is not a number", env=torchrun_env(RANK="abc"), keep="absent"),
        C("e03", "environment", "a shutdown timeout that is not a number", (*UNIT, *TWO, *R), 2, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='abc'", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "abc"}, keep="absent"),
        C("e04", "environment", "a MASTER_PORT nothing listens on", (*UNIT, *TWO, *R), 2, "cannot reach torchrun's store at .* within 10 s", env=torchrun_env(MASTER_PORT=free_port()), keep="absent"),
        C("e05", "environment", "hydra.run.dir under a file", (*UNIT, "hydra.run.dir=afile/run"), 2, r"^composerun: error: cannot write afile/run: Not a directory; choose a writable hydra\.run\.dir$", prepare=write("afile", "x")),
        C("e06", "environment", "an empty hydra.run.dir", (*UNIT, "hydra.run.dir="), 2, r"^composerun: error: hydra\.run\.dir is empty: name a directory for the run, or leave it out \(outputs/DATE/TIME\)$", check=nothing_written),
        C("e14", "environment", "a quoted empty hydra.run.dir", (*UNIT, "hydra.run.dir=''"), 2, r"^composerun: error: hydra\.run\.dir is empty: name a directory for the run, or leave it out \(outputs/DATE/TIME\)$", check=nothing_written),
        C("e15", "environment", "an empty hydra.sweep.dir", ("-m", *UNIT, "hydra.sweep.dir="), 2, r"^composerun: error: hydra\.sweep\.dir is empty: name a directory for the run, or leave it out \(outputs/DATE/TIME\)$", check=nothing_written),
        C("e07", "environment", "a run directory another run holds", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 2, r"is in use by another composerun run \(pid \d+", prepare=hold_lock, keep="same"),
        C("e08", "environment", "the lock of a killed run", (*FINISHED_ARGS[:-2], "train.steps=6", *R), 0, prepare=dead_lock, keep="trained", check=completed(6)),
        C("e09", "environment", "a WORLD_SIZE the mesh does not fit", (*UNIT, "mesh=2x2", *R), 2, "WORLD_SIZE is 2", env=torchrun_env(MASTER_PORT=free_port(), TORCHELASTIC_USE_AGENT_STORE="False"), keep="absent"),
        C("e10", "environment", "a RANK outside WORLD_SIZE", (*UNIT, *TWO, *R), 2, "RANK=5 with WORLD_SIZE=2", env=torchrun_env(RANK="5"), keep="absent"),
        C("e11", "environment", "a shutdown timeout with a fraction", (*UNIT, *TWO, *R), 2, r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT='30\.5'", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30.5"}, keep="absent"),
        C("e12", "environment", "torchrun without its agent store and no hydra.run.dir", (*UNIT, *TWO), 2, r"give one with hydra\.run\.dir", env=torchrun_env(TORCHELASTIC_USE_AGENT_STORE="False")),
        C("e13", "environment", "a second command while the first is starting", (*FINISHED_ARGS, *R), 2, r"is in use by another composerun run", prepare=running_first_steps, keep="same"),
    ]
    long = (*UNIT, *TWO, "train.steps=100000", "checkpoint.every=1000", *R)
    sig = [
        C("g01", "signals", "SIGTERM to the launcher", long, 75, r"preempted \(SIGTERM\) at step \d+: checkpoint saved", act=when_logged(3, to_launcher(signal.SIGTERM)), check=preempted_with_checkpoint),
        C("g02", "signals", "SIGTERM to the process group (SLURM, Kubernetes)", long, 75, r"^composerun: preempted \(SIGTERM\) at step \d+: checkpoint saved to \S+; run the same command with hydra\.run\.dir=\S+ to resume$", act=when_logged(3, to_group(signal.SIGTERM)), check=preempted_once),
        C("g03", "signals", "SIGUSR1 to the process group", long, 75, r"preempted \(SIGUSR1\) at step \d+: checkpoint saved", act=when_logged(3, to_group(signal.SIGUSR1)), check=preempted_with_checkpoint),
        C("g04", "signals", "Ctrl-C (SIGINT to the group)", long, 130, r"interrupted \(SIGINT\)", act=when_logged(3, to_group(signal.SIGINT))),
        C("g05", "signals", "SIGHUP to a run started under nohup", (*UNIT, *TWO, "train.steps=60", *R), 0, prog="nohup", act=when_logged(3, to_group(signal.SIGHUP)), check=completed(60)),
        C("g06", "signals", "the launcher SIGKILLed", long, -9, act=when_logged(3, kill_launcher), check=ranks_gone),
        C("g07", "signals", "SIGTERM while planning", (*UNIT, "mesh=300x300", "plan=true", "hydra.run.dir=plan"), 143, r"^composerun: interrupted \(SIGTERM\): planning stopped; no plan written$", keep="absent", act=during_plan),
        C("g08", "signals", "Ctrl-C while the ranks start", (*UNIT, *TWO, "train.steps=5", *R), 130, r"interrupted \(SIGINT\)", act=after(2.5, signal.SIGINT)),
        C("g09", "signals", "Ctrl-C while composerun imports", (*UNIT, *TWO, "train.steps=5", *R), 130, r"interrupted \(SIGINT\)", act=after_cpu(0.2, signal.SIGINT)),
    ]
    disk = [
        C("f01", "disk", "the disk fills up during a save", ("+model=unit", "model.dim=96", *TWO, "train.steps=4", "checkpoint.every=2", "hydra.run.dir=full/run"), 1, "is full|No space left", prepare=mounted_full, check=disk_full_left, needs=can_mount),
    ]
    cli = [
        C("x01", "ckpt-cli", "inspect a path that does not exist", ("inspect", "nowhere"), 2, "nowhere: no such file", prog="composerun-ckpt"),
        C("x02", "ckpt-cli", "export to a path under a file", ("export", "run", "afile/model.safetensors"), 2, "afile.*not a directory", prog="composerun-ckpt", given="finished", prepare=write("afile", "x"), keep="same"),
        C("x03", "ckpt-cli", "export to a name that is not .safetensors", ("export", "run", "model.bin"), 2, r"must end in \.safetensors", prog="composerun-ckpt", given="finished", keep="same"),
        C("x04", "ckpt-cli", "export a tampered checkpoint", ("export", "run", "model.safetensors"), 1, "refusing to export: .*checksum mismatch", prog="composerun-ckpt", given="finished", prepare=lambda ws: flip_byte(newest(ws) / "__0_0.distcp", -40), keep="same", check=lambda ws, r: ["model.safetensors written"] if (ws / "model.safetensors").exists() else []),
    ]
    return cfg + mesh + rules + ck + data + sweeps + env + sig + disk + cli
    # fmt: on


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _export(ws: Path) -> None:
    r = composerun("export", "run", "run/export/model.safetensors", cwd=ws, prog="composerun-ckpt")
    if r.returncode != 0:
        raise RuntimeError(r.stderr)


def _sweep(ws: Path, *args: str) -> None:
    r = composerun("-m", *UNIT, *args, "hydra.sweep.dir=sweep", cwd=ws)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])


FIXTURES: dict[str, Path] = {}
HELPERS: list[subprocess.Popen] = []
# The fork process (scripts/one_process.py --fork) while the catalog runs; none with --as-typed.
FORKS: list[Any] = []


# --- running a case ------------------------------------------------------------------------------


@dataclass
class Result:
    case: Case
    code: int | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None
    line: str = ""


def run_case(case: Case, root: Path) -> Result:
    started = _begin(case, root)
    if isinstance(started, Result):
        return started
    try:
        code, out, err, pgid = _execute(case, started.ws)
    except Exception as e:  # noqa: BLE001 - a case that could not even run is a failed case
        return _end(started, error=e)
    return _end(started, code, out, err, pgid)


@dataclass
class Started:
    """A case whose directory is set up, and what its named directory held before."""

    case: Case
    ws: Path
    target: Path
    before: dict[str, str]
    t0: float


def _begin(case: Case, root: Path) -> Started | Result:
    """The case's directory and set-up; a Result when it is skipped or its set-up failed."""
    if case.needs and (why := case.needs()):
        return Result(case, skipped=why)
    ws = root / case.id
    ws.mkdir(parents=True)
    t0 = time.monotonic()
    try:
        if case.given == "finished":
            shutil.copytree(FIXTURES["finished"], ws / "run", symlinks=True)
        if case.prepare:
            case.prepare(ws)
        target = _named_dir(case, ws)
        return Started(case, ws, target, snapshot(target), t0)
    except Exception as e:  # noqa: BLE001 - a case that could not even run is a failed case
        _unmount(ws)
        return Result(case, problems=[f"{type(e).__name__}: {e}"], seconds=time.monotonic() - t0)


def _end(
    s: Started, code: int = 0, out: str = "", err: str = "", pgid: int = 0, error: Exception | None = None
) -> Result:
    """What must hold once the command has ended."""
    res = Result(s.case, code, time.monotonic() - s.t0)
    try:
        if error is not None:
            raise error
        res.problems += _one_line(s.case, code, out, err, res)
        if s.case.keep:
            res.problems += kept_problems(s.before, s.target, s.case.keep)
        if s.case.check:
            proc = subprocess.CompletedProcess([], code, out, err)
            proc.pgid = pgid  # type: ignore[attr-defined]
            res.problems += s.case.check(s.ws, proc)
    except Exception as e:  # noqa: BLE001 - a case that could not even run is a failed case
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        _unmount(s.ws)
    return res


def _unmount(ws: Path) -> None:
    if (ws / "full").is_mount():
        subprocess.run(["umount", str(ws / "full")], check=False)


def run_in_one_process(selected: list[Case], root: Path) -> list[Result]:
    """The cases' commands one after another in one process (scripts/one_process.py), each
    set up before and checked after as if it had run alone."""
    from one_process import run_commands

    begun = [_begin(c, root) for c in selected]
    todo = [s for s in begun if isinstance(s, Started)]
    try:
        procs = run_commands([(list(s.case.args), s.ws) for s in todo], timeout=RUN_TIMEOUT * 3)
    except Exception as e:  # noqa: BLE001 - every case of the process failed with it
        ended = {s.case.id: _end(s, error=e) for s in todo}
    else:
        ended = {}
        for s, p in zip(todo, procs, strict=True):
            ended[s.case.id] = res = _end(s, p.returncode, p.stdout, p.stderr, os.getpgid(0))
            res.seconds = p.seconds  # the command's own time (the set-ups ran before)
    return [ended.get(s.case.id, s) if isinstance(s, Started) else s for s in begun]  # type: ignore[misc]


def _named_dir(case: Case, ws: Path) -> Path:
    """The run directory the command names (the one whose contents must be kept)."""
    for a in case.args:
        if a.startswith("hydra.sweep.dir="):
            return ws / a.split("=", 1)[1]
        if a.startswith("hydra.run.dir="):
            name = a.split("=", 1)[1]
            if case.given == "finished" and name != "run" and case.keep == "same":
                return ws / "run"  # the finished run another command reads from
            return ws / name if name else ws
    return ws / "run"


AS_TYPED = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"


def _execute(case: Case, ws: Path) -> tuple[int, str, str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    env.update({"PYTHONWARNINGS": "ignore", **case.env})
    if FORKS and forked(case):
        proc: Any = FORKS[0].start(case.prog, list(case.args), ws, env, ws / "stdout", ws / "stderr")
    else:
        proc = _as_typed(case, ws, env)
    try:
        if case.act:
            case.act(proc, ws)
        code = proc.wait(timeout=case.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"no exit within {case.timeout} s") from None
    finally:
        if case.id != "g06" and group_members(proc.pid):  # g06 checks its own leftovers
            time.sleep(1)
            if group_members(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
    return code, (ws / "stdout").read_text(), (ws / "stderr").read_text(), proc.pid


def _as_typed(case: Case, ws: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [str(BIN / case.prog), *case.args]
    if case.prog == "nohup":
        cmd = ["nohup", str(BIN / "composerun"), *case.args]
    # as typed in a terminal: Ctrl-C's SIGINT acts (a CI job in the background inherits it ignored)
    cmd = [sys.executable, "-c", AS_TYPED, *cmd]
    with open(ws / "stdout", "w") as out, open(ws / "stderr", "w") as err:
        return subprocess.Popen(
            cmd, cwd=ws, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
        )


def _one_line(case: Case, code: int, out: str, err: str, res: Result) -> list[str]:
    problems = []
    if code != case.code:
        problems.append(f"exit {code}, not {case.code}: {err.strip()[-400:]}")
    if "Traceback" in out + err:
        problems.append("a traceback was printed")
    prefix = f"{case.prog}: " if case.prog != "nohup" else "composerun: "
    lines = [ln for ln in err.splitlines() if ln.startswith(prefix) and "resuming" not in ln]
    if case.code not in (0, -9):
        others = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(prefix)]
        if len(lines) != 1 or others:
            problems.append(f"not one line on stderr: {err.strip()[-400:]!r}")
        res.line = lines[0] if lines else ""
        if case.line and lines and not re.search(case.line, lines[0]):
            problems.append(f"the line does not match {case.line!r}: {lines[0]!r}")
    elif any("error" in ln for ln in lines):
        problems.append(f"an error line from a command that must succeed: {lines}")
    return problems


def run_catalog(selected: list[Case], root: Path, jobs: int = 2, as_typed: bool = False) -> list[Result]:
    """Every case; the config-only ones (`checked_here`) in one worker process of their own,
    beside the others, unless `as_typed` (each case its own command, as a user types it)."""
    here = [] if as_typed else [c for c in selected if checked_here(c)]
    typed = [c for c in selected if c not in here]
    if not as_typed:
        from one_process import Forks

        FORKS.append(Forks())
    try:
        FIXTURES["finished"] = make_finished(root)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            batch = pool.submit(run_in_one_process, here, root) if here else None  # first: it is the longest
            done = list(pool.map(lambda c: run_case(c, root), typed))
            done += batch.result() if batch else []
    finally:
        for helper in HELPERS:
            helper.kill()
            helper.wait()
        while FORKS:
            FORKS.pop().close()
    by_id = {r.case.id: r for r in done}
    return [by_id[c.id] for c in selected]


# --- config-only cases, in one process -----------------------------------------------------------
#
# Most of a config-only case (exit 2 before any rank starts) is a Python process importing torch
# and Hydra.  Those cases are set up here, their commands run one after another in one process
# (scripts/one_process.py: through the function the `composerun` script calls, stdout and stderr
# captured at the file descriptors), and checked here: the same line, exit code and directory.  A
# handful of them (AS_TYPED_SAMPLE), and every case that needs an environment, a signal, a sweep,
# ranks or another program, still run as typed.

AS_TYPED_SAMPLE = {  # one a family
    "c01",  # a schema check's line (validate)
    "m01",  # the mesh argument quoted before Hydra reads it
    "r03",  # the policy checked on a meta model
    "k04",  # a finished run's checkpoint checked, its directory byte-for-byte as it was
    "d05",  # the data source checked
}


def checked_here(case: Case) -> bool:
    """A config-only case that can run in the worker: exit 2, nothing done to the command while
    it runs, no environment of its own, composerun itself, no sweep (its jobs start ranks)."""
    return (
        case.code == 2
        and case.act is None
        and not case.env
        and case.prog == "composerun"
        and "-m" not in case.args
        and case.id not in AS_TYPED_SAMPLE
    )


def forked(case: Case) -> bool:
    """A case whose command forks from the fork process: one not checked in the worker, not
    of the sample kept as typed, not under nohup, and acted on, if at all, only once it has
    started (a step logged, its plan begun: `after_start`); a signal at a fixed time may come
    while it imports, and its start-up is what such a case is about.  A case with a PYTHONPATH
    of its own (a user's module) forks too: the child puts it on sys.path as the interpreter
    would, and the cases' folders hold no composerun of their own."""
    acts_later = case.act is None or getattr(case.act, "after_start", False)
    return (
        acts_later
        and case.prog != "nohup"
        and case.id not in AS_TYPED_SAMPLE
        and not checked_here(case)
    )


def report(results: list[Result]) -> str:
    rows = ["| id | family | case | exit | holds | seconds |", "|---|---|---|---|---|---|"]
    for r in results:
        holds = "skipped: " + r.skipped if r.skipped else ("yes" if not r.problems else "NO: " + "; ".join(r.problems))
        rows.append(f"| {r.case.id} | {r.case.family} | {r.case.what} | {r.code} | {holds} | {r.seconds:.1f} |")
    ran = [r for r in results if not r.skipped]
    good = [r for r in ran if not r.problems]
    families = sorted({r.case.family for r in results})
    rows.append("")
    rows.append(
        f"{len(good)} of {len(ran)} cases hold: one line, the right exit, nothing lost "
        f"({len(results) - len(ran)} could not run here; families: {', '.join(families)})"
    )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    p.add_argument("--only", default="", help="comma-separated case ids")
    p.add_argument("--family", default="", help="comma-separated families")
    p.add_argument("--out", type=Path, default=None, help="where the cases run (default: a temporary folder)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--as-typed", action="store_true", help="every case its own command (config-only ones too)")
    args = p.parse_args()
    selected = cases()
    if args.only:
        selected = [c for c in selected if c.id in args.only.split(",")]
    if args.family:
        selected = [c for c in selected if c.family in args.family.split(",")]
    if args.list:
        for c in selected:
            print(f"{c.id}  {c.family:12} {c.what}: {' '.join(c.args)} -> {c.code}")
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="composerun-bad-inputs-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run_catalog(selected, root, args.jobs, args.as_typed)
    print(report(results))
    print(f"{time.monotonic() - t0:.0f} s; cases ran in {root}")
    sys.exit(0 if all(not r.problems for r in results) else 1)


if __name__ == "__main__":
    main()
