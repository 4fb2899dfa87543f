"""Two nodes on loopback (end-to-end): two torchrun agents x 1 rank, c10d rendezvous.

Each "node" is one `torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d` agent started
in a session of its own; both name the same rendezvous endpoint 127.0.0.1:PORT.  Which agent
hosts the rendezvous store is decided by torch, not by a flag: every agent whose endpoint
host is a loopback address tries to host it, the one that binds the port first does, and
the other falls back to a client (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py,
`_create_tcp_store`).  `--local-addr 127.0.0.1` makes both nodes publish that address.

A node is killed as a machine losing power would be: SIGKILL to its agent and to each of its
ranks, which torch starts in sessions of their own (subprocess_handler.py: start_new_session),
so killing the agent's process group alone would leave the ranks running.  One rank a node is
enough for what is checked here (global rank 0 is not node 1's local rank 0 either way); a 2-D
mesh over two nodes of 2 ranks is test_elastic_loopback.py's and test_slurm.py's.

1. killed: both nodes run without hydra.run.dir, so the two ranks on two agents must agree on
   one timestamped run directory through the agent store; once a checkpoint is published, the
   node holding global rank 0 is killed, and the other node must exit non-zero by itself;
2. restarted: both nodes start again with hydra.run.dir naming that directory (a new rendezvous
   id and port), resume from `latest` and finish with the reference's weights, bit for bit.

The reference is the same run self-launched on one node (2 ranks forked from this process's
fork server): a two-node run ends with the same weights as a one-node one, as composerun seeds
one initialization and indexes data by sample position, and this test says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import final_weights, patience, read_metrics, train

pytestmark = pytest.mark.e2e

STEPS, EVERY = 20, 4
ARGS = ("+model=unit", "model.dim=8", "mesh=2", f"train.steps={STEPS}", f"checkpoint.every={EVERY}")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RUN_TIMEOUT = patience(180)  # seconds for both nodes of a run to finish (a hang guard)
SURVIVOR_TIMEOUT = 120  # seconds for the surviving node to give up by itself (it takes ~2 s here)


# --- processes -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (a node's ranks are its agent's children)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (f := _stat_fields(int(entry.name))) and int(f[1]) == pid and f[0] != "Z":
            kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    f = _stat_fields(pid)
    return f is not None and f[0] != "Z"


def env_var(pid: int, key: str) -> str | None:
    try:
        items = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in items:
        name, _, value = item.decode(errors="replace").partition("=")
        if name == key:
            return value
    return None


def descendants(pid: int) -> list[int]:
    """Live processes below `pid`, every generation (a self-launched node's ranks are its fork
    server's children)."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node's agent and every rank at once; return when none of them is alive."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=patience(30))
    deadline = time.monotonic() + patience(10)
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes {left} of node {proc.pid} survived SIGKILL"


class Node:
    """One torchrun agent (a node) and the ranks it starts."""

    def __init__(self, cwd: Path, tag: str, port: int, rdzv_id: str, *extra: str) -> None:
        cmd = [
            TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--rdzv-conf", "join_timeout=120", "--local-addr", "127.0.0.1",
            "-m", "composerun", *ARGS, "metrics.progress=false", *extra,
        ]  # fmt: skip
        self.out = cwd / f"{tag}.out"
        self.ranks: list[int] = []
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def read_ranks(self) -> list[int]:
        """The global ranks of this node's workers (from their environment)."""
        ranks = [env_var(pid, "RANK") for pid in children(self.proc.pid)]
        self.ranks = sorted(int(r) for r in ranks if r is not None)
        return self.ranks

    def kill(self) -> None:
        kill_node(self.proc)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def tail(self) -> str:
        return self.out.read_text()[-3000:]


def start_nodes(cwd: Path, *extra: str) -> list[Node]:
    cwd.mkdir(parents=True, exist_ok=True)
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    return [Node(cwd, f"node{i}", port, rdzv_id, *extra) for i in (0, 1)]


def finish(nodes: list[Node], what: str) -> None:
    codes = [n.wait(RUN_TIMEOUT) for n in nodes]
    for node, rc in zip(nodes, codes, strict=True):
        if rc is None:
            node.kill()
        assert rc == 0, f"{what}: {node.out.name} exited {rc}:\n{node.tail()}"


def wait_for_checkpoint(nodes: list[Node], latests: Callable[[], list[Path]]) -> str:
    """What `checkpoints/latest` names once one of `latests()` is published."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (found := [p for p in latests() if p.is_symlink()]):
        ended = [n.out.name for n in nodes if n.proc.poll() is not None]
        assert not ended, f"{ended} ended before a checkpoint was published:\n{nodes[0].tail()}"
        assert time.monotonic() < deadline, f"no checkpoint published in {RUN_TIMEOUT} s"
        time.sleep(0.02)
    return os.readlink(found[0])


# --- the runs ----------------------------------------------------------------------------------


def run_dirs(cwd: Path) -> list[Path]:
    """The timestamped run directories under `cwd`/outputs."""
    return sorted(p for p in (cwd / "outputs").glob("*/*") if p.is_dir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("multinode")
    started: list[Node] = []
    out: dict[str, Any] = {"root": root}
    try:
        cwd = root / "killed"
        nodes = start_nodes(cwd)
        started += nodes
        out["seen"] = wait_for_checkpoint(nodes, lambda: [d / "checkpoints" / "latest" for d in run_dirs(cwd)])
        out["ranks"] = [n.read_ranks() for n in nodes]
        # what the two nodes made of the run directory, read before a restart writes into it again
        out["run_dirs"] = run_dirs(cwd)
        out["hydra"] = sorted(p.relative_to(cwd) for p in cwd.rglob(".hydra"))
        out["rank_logs"] = sorted(p.name for d in out["run_dirs"] for p in d.glob("rank*.log"))
        # the node with global rank 0 (it writes the manifests and hosts the ranks' store)
        victim = next((n for n in nodes if 0 in n.ranks), nodes[0])
        survivor = nodes[1 - nodes.index(victim)]
        victim.kill()
        out["survivor_rc"] = survivor.wait(SURVIVOR_TIMEOUT)
        out["survivor_out"] = survivor.tail()
        if out["survivor_rc"] is None:
            survivor.kill()
        (run,) = out["run_dirs"]
        out["run"] = run
        out["latest_after_kill"] = os.readlink(run / "checkpoints" / "latest")

        again = start_nodes(cwd, f"hydra.run.dir={run}")
        started += again
        finish(again, "the restarted run")
    finally:
        for node in started:
            if node.proc.poll() is None or children(node.proc.pid):
                node.kill()
    # the uninterrupted reference: one node's 2 ranks
    train(root / "reference", *ARGS)
    return out


def test_two_nodes_agree_on_one_run_dir(runs: dict[str, Any]) -> None:
    """Without hydra.run.dir, both nodes' ranks write into one timestamped run directory,
    and only global rank 0 writes .hydra/; the restart completes it."""
    cwd = runs["root"] / "killed"
    assert len(runs["run_dirs"]) == 1, runs["run_dirs"]
    run = runs["run"]
    assert runs["hydra"] == [(run / ".hydra").relative_to(cwd)]
    assert runs["rank_logs"] == [f"rank{r}.log" for r in range(2)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    assert [row["step"] for row in read_metrics(run)] == list(range(1, STEPS + 1))


def test_each_node_runs_one_of_the_two_ranks(runs: dict[str, Any]) -> None:
    assert sorted(runs["ranks"]) == [[0], [1]], runs["ranks"]


def test_surviving_node_exits_nonzero_by_itself(runs: dict[str, Any]) -> None:
    """Killing the node with rank 0 mid-run ends the other node too (its ranks' collectives
    fail, its agent exits non-zero) rather than leaving it waiting."""
    rc = runs["survivor_rc"]
    assert rc is not None, f"the surviving node still ran {SURVIVOR_TIMEOUT} s after the kill"
    assert rc != 0, runs["survivor_out"]
    # the kill came mid-run: a checkpoint before the last one was the newest published
    assert runs["latest_after_kill"] < f"step-{STEPS:08d}", runs["latest_after_kill"]


def test_restarted_nodes_resume_bitwise_equal(runs: dict[str, Any]) -> None:
    """Both nodes started again resume from `latest` and end with the uninterrupted run's
    (one node's 2 ranks) weights and per-step metrics, bit for bit."""
    run, reference = runs["run"], runs["root"] / "reference"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    assert Path(summary["resumed_from"]).name == runs["latest_after_kill"]
    assert 0 < summary["start_step"] < STEPS
    assert [p.relative_to(run) for p in run.rglob(".hydra")] == [Path(".hydra")]
    assert run_dirs(runs["root"] / "killed") == [run], "a node's ranks made a run directory of their own"

    got, want = final_weights(run, *ARGS), final_weights(reference, *ARGS)
    assert list(got) == list(want)
    for key in want:
        assert got[key].numpy().tobytes() == want[key].numpy().tobytes(), f"{key} differs from the reference"
    by_step = {r["step"]: r for r in read_metrics(reference)}
    rows = read_metrics(run)
    assert rows[-1]["step"] == STEPS
    for r in rows:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == by_step[r["step"]][key], f"step {r['step']} {key} differs from the reference"
