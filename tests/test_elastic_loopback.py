"""A node lost, the training kept (end-to-end, loopback): two torchrun agents x 2 ranks with
`--nnodes=1:2 --max-restarts=N`, a c10d rendezvous on 127.0.0.1 and mesh.elastic=true; and the
same through composerun's SLURM launcher (`lost`'s second parameter): two `composerun` "tasks"
with the environment SLURM gives each task of a job (test_slurm.py's way) and the node range
`launch.nodes=2 launch.min_nodes=1`, each its own agent (composerun's, in-process) of 2 ranks.

Once a checkpoint is published, one node is killed as a machine losing power would be (its
agent and its ranks, SIGKILL: test_multinode.py's way).  The other node's ranks fail on the
dead peer at once (gloo's connections close); its agent, which has restarts left, stops them
and meets the rendezvous again.  That round completes with this node alone once the dead
agent's keep-alive has expired (keep_alive_interval x keep_alive_max_attempt) and the last
call has passed (last_call_timeout); the new ranks see WORLD_SIZE=2, composerun runs them on
the mesh mesh.elastic picks (2x2 -> 1x2, train.grad_accum 1 -> 2, data.batch_size kept) and
they resume from `latest`.  On SLURM they finish the run there.  Under torchrun the killed
node then comes back (a new agent, the same rendezvous) once the survivors have trained a step
on 1x2 (their steps wait for it: slow.py's hold file); the agents re-form at the membership
change and the run ends on 2x2: one run shows the node lost and the node back.

The killed node is the one that does not host the rendezvous' store (every agent tries to
host it on the endpoint's port; the survivor must be the one that did).  On SLURM that is the
job's first task (composerun's agents are told which one hosts): the one that holds the run
directory's lock.

The reference is made by hand: the same run stopped at the checkpoint the survivors resumed
and resumed on 1x2 with twice the micro-batches (and, under torchrun, stopped again at the
step the node came back at and resumed on 2x2); the final weights must be equal, bit for bit.  The time from the kill to the end of the survivors' first step is
printed (run pytest with -s to see it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import cli, final_weights, patience, read_metrics, train
from test_multinode import children, free_port, kill_node

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 2
# optim.schedule=constant (after the warmup): the LR then depends on the step alone, so that the
# legs of a hand-made reference can stop at a checkpoint by train.steps (a cosine's LR depends on it)
ARGS = (
    "+model=unit",
    "model.dim=8",
    "sharding=hsdp",
    "optim.schedule=constant",
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
COMPOSERUN = str(Path(sys.executable).with_name("composerun"))
# The rendezvous' timings, short for a test (torch's defaults: keep-alive every 5 s, 3 missed
# make a node dead; a 30 s last call): they bound the time from a node's death to the restart.
# The last call is also how long the first agent in waits for the other: at 3 s, a loaded
# machine once started the second agent's ranks too late, and the first node trained alone.
RDZV_CONF = "join_timeout=120,last_call_timeout=15,keep_alive_interval=1,keep_alive_max_attempt=3"
RUN_TIMEOUT = patience(180)


class Node:
    """One elastic agent (a node) and the ranks it starts: torchrun's, or with `task` (SLURM's
    task id) composerun's own, as hydra/launcher=slurm runs it on each node of a job."""

    def __init__(
        self, cwd: Path, tag: str, port: int, rdzv_id: str, run: Path, task: int | None = None, **env: str
    ) -> None:
        run_args = [*ARGS, "model._target_=slow.SlowUnit", "mesh=2x2", "mesh.elastic=true", f"hydra.run.dir={run}",
                    "metrics.progress=false"]  # fmt: skip
        if task is None:
            cmd = [
                TORCHRUN, "--nnodes", "1:2", "--nproc_per_node", "2", "--max-restarts", "2", "--monitor-interval", "0.5",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                "--rdzv-conf", RDZV_CONF, "--local-addr", "127.0.0.1", "-m", "composerun", *run_args,
            ]  # fmt: skip
            # (a restart must not read the dead attempt's store)
            env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
        else:  # (composerun sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE itself for agents that restart)
            conf = ", ".join(f"{k}: {v}" for k, v in (kv.split("=") for kv in RDZV_CONF.split(",")))
            cmd = [COMPOSERUN, *run_args, "launch.nodes=2", "launch.min_nodes=1", "launch.max_restarts=2",
                   "launch.monitor_interval=0.5", f"launch.rdzv_port={port}", f"launch.rdzv_conf={{{conf}}}"]  # fmt: skip
            job = {"SLURM_JOB_ID": str(port), "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
                   "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": str(task)}  # fmt: skip
            env = {**job, **env}
        self.out = cwd / f"{tag}.out"
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": f"{REPO / 'tests' / 'fixtures'}:{REPO}", **env}
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def holds_port(self, port: int) -> bool:
        """Whether this agent listens on `port` (hosts the rendezvous' store)."""
        inodes = set()
        for table in ("tcp", "tcp6"):
            for line in (Path("/proc/net") / table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                    inodes.add(f[9])
        try:
            fds = list((Path("/proc") / str(self.proc.pid) / "fd").iterdir())
        except OSError:
            return False
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
        return False

    def kill(self) -> None:
        kill_node(self.proc)

    def tail(self) -> str:
        return self.out.read_text()[-4000:]


def wait_for(what: str, done, nodes: list[Node]) -> None:
    """Until `done()`, or fail naming `what` (with the nodes' output) when a node ends first."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not done():
        ended = [n.out.name for n in nodes if n.proc.poll() is not None]
        assert not ended, f"{ended} ended before {what}:\n" + "\n".join(n.tail() for n in nodes)
        assert time.monotonic() < deadline, f"no {what} in {RUN_TIMEOUT} s"
        time.sleep(0.02)


def lose_a_node(nodes: list[Node], port: int, run: Path, out: dict) -> Node:
    """Once a checkpoint is published, SIGKILL the node that does not host the rendezvous'
    store; the survivor."""
    latest = run / "checkpoints" / "latest"
    wait_for("a published checkpoint", latest.is_symlink, nodes)
    host = [n for n in nodes if n.holds_port(port)]
    assert len(host) == 1, "no single agent hosts the rendezvous' store"
    victim = nodes[1 - nodes.index(host[0])]
    out["seen"] = os.readlink(latest)
    victim.kill()
    out["killed_unix"] = time.time()
    return host[0]


def finish(node: Node) -> int | None:
    try:
        return node.proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None


def rows_now(run: Path) -> list[dict]:
    """metrics.jsonl's complete rows while the run writes it."""
    rows = []
    try:
        text = (run / "metrics.jsonl").read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def stop(nodes: list[Node]) -> None:
    for node in nodes:
        if node.proc.poll() is None or children(node.proc.pid):
            node.kill()


@pytest.fixture(scope="module")
def lost_then_back(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """torchrun: a node lost; once the survivors have trained a step on 1x2, it comes back (a new
    agent, the same rendezvous) and the run ends on 2x2."""
    root = tmp_path_factory.mktemp("elastic-torchrun")
    run, hold = root / "run", root / "hold"
    hold.touch()  # the survivors' steps wait (slow.py) until the node is back: the run cannot end first
    env = {"SLOW_HOLD_FILE": str(hold), "SLOW_HOLD_WORLD": "2"}
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    out: dict = {"root": root, "run": run, "launcher": "torchrun"}
    nodes = [Node(root, f"node{i}", port, rdzv_id, run, **env) for i in (0, 1)]
    try:
        survivor = lose_a_node(nodes, port, run, out)
        wait_for("a step on the smaller mesh", lambda: any("mesh_change" in r for r in rows_now(run)), [survivor])
        nodes.append(Node(root, "node2", port, rdzv_id, run, **env))
        out["codes"] = [finish(survivor), finish(nodes[2])]
        out["survivor_rc"], out["survivor_index"] = out["codes"][0], nodes.index(survivor)
        out["survivor_text"] = survivor.out.read_text()
        out["survivor_out"] = survivor.tail() + nodes[2].tail()
    finally:
        hold.unlink(missing_ok=True)
        stop(nodes)
    return out


@pytest.fixture(scope="module")
def lost_on_slurm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """composerun's SLURM launcher: a node lost, the survivors finish the run on 1x2."""
    root = tmp_path_factory.mktemp("elastic-slurm")
    run = root / "run"
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    out: dict = {"root": root, "run": run, "launcher": "slurm"}
    nodes = [Node(root, f"task{i}", port, rdzv_id, run, task=i) for i in (0, 1)]
    try:
        survivor = lose_a_node(nodes, port, run, out)
        out["survivor_rc"] = finish(survivor)
        out["survivor_out"] = survivor.tail()
        out["survivor_text"] = survivor.out.read_text()
        out["survivor_index"] = nodes.index(survivor)
    finally:
        stop(nodes)
    return out


@pytest.fixture(params=["torchrun", "slurm"])
def lost(request: pytest.FixtureRequest) -> dict:
    """A node lost on either launch path (torchrun's run also sees the node come back)."""
    return request.getfixturevalue({"torchrun": "lost_then_back", "slurm": "lost_on_slurm"}[request.param])


SMALLER = ("mesh=2x2", "mesh.shape=[1,2]", "train.grad_accum=2")  # 1x2, the same global batch


def check_against_hand_resumed(run: Path, ref: Path, changes: list[dict]) -> None:
    """The reference by hand: stopped at each change's checkpoint and resumed on its new mesh
    (the last leg to the end); the final weights must be equal, bit for bit."""
    ends = [c["step"] for c in changes] + [STEPS]
    meshes = ["2x2"] + [c["new_mesh"] for c in changes]
    for mesh, end in zip(meshes, ends, strict=True):
        train(ref, *ARGS[:4], *(SMALLER if mesh == "1x2" else ("mesh=2x2",)), f"train.steps={end}",
              f"checkpoint.every={EVERY}")  # fmt: skip
    got, want = final_weights(run, *ARGS), final_weights(ref, *ARGS)
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the hand-resumed reference"
    assert [r["step"] for r in read_metrics(run)] == list(range(1, STEPS + 1))


def test_survivors_go_on_on_the_smaller_mesh_bit_equal(lost: dict) -> None:
    """The survivors restart on 1x2 from `latest` (and, on SLURM, finish there); the run ends
    bit-equal to one resumed by hand at the same steps."""
    run, root = lost["run"], lost["root"]
    assert lost["survivor_rc"] == 0, lost["survivor_out"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS, summary
    changes = summary["mesh_changes"]
    assert [r["mesh_change"] for r in read_metrics(run) if "mesh_change" in r] == changes
    text = lost["survivor_text"]
    line = "composerun: mesh.elastic: a world of 2 ranks: mesh 2x2 -> 1x2 (replicate changes), train.grad_accum 1 -> 2"
    assert line in text, lost["survivor_out"]
    if lost["launcher"] == "slurm":  # the node range reached the agents; the lead task survived; it ends on 1x2
        assert lost["survivor_index"] == 0
        assert "1-2 nodes: 2 ranks on this one" in text, lost["survivor_out"]
        assert summary["mesh"] == "1x2" and summary["world_size"] == 2 and len(changes) == 1
    last = changes[-1]  # the restart the run last resumed at (torchrun's: the node's return)
    assert last["step"] == summary["start_step"] == int(Path(summary["resumed_from"]).name.split("-")[1])
    shrink = changes[0]
    assert 0 < shrink["step"] < STEPS, "the node was killed after the run's end"
    assert (shrink["old_mesh"], shrink["new_mesh"], shrink["old_grad_accum"], shrink["grad_accum"]) == (
        "2x2",
        "1x2",
        1,
        2,
    )
    recovery = summary["first_step_end_unix"] - lost["killed_unix"]
    print(
        f"\nelastic loopback ({lost['launcher']}): node killed after {lost['seen']}; the survivors resumed "
        f"on 1x2 and ended their first step {recovery:.1f} s after the kill ({shrink['seconds_lost']:.1f} s "
        "after the checkpoint was published)"
    )
    check_against_hand_resumed(run, root / "reference", changes)


def test_a_node_back_joins_at_the_next_restart(lost_then_back: dict) -> None:
    """The killed node comes back (a new agent, the same rendezvous) while the survivors train
    on 1x2: torch's agents re-form at the membership change (the survivors are asked to stop:
    they save the step they are in and exit), and the run goes on on 2x2 with train.grad_accum 1
    and the same global batch.  (That it ends bit-equal to a run stopped and resumed by hand at
    the same two checkpoints, 2x2 -> 1x2 -> 2x2, is the test above's torchrun case.)"""
    run = lost_then_back["run"]
    assert lost_then_back["codes"] == [0, 0], lost_then_back["survivor_out"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS and summary["mesh"] == "2x2", summary
    assert summary["world_size"] == 4
    shrink, grow = summary["mesh_changes"]
    assert (grow["old_mesh"], grow["new_mesh"], grow["old_grad_accum"], grow["grad_accum"]) == ("1x2", "2x2", 2, 1)
    assert 0 < shrink["step"] < grow["step"] < STEPS, (shrink, grow)


def test_a_world_the_rule_cannot_take_is_refused(tmp_path: Path) -> None:
    """The shard dim (2) must stay, and one rank is left: one line, exit 2, the run's
    checkpoint as it was."""
    run = tmp_path / "run"
    train(run, "+model=unit", "model.dim=8", "mesh=2x2", "train.steps=2", "checkpoint.every=2")
    files = sorted(p for p in (run / "checkpoints").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    r = cli(
        *("--standalone", "--nproc_per_node", "1", "-m", "composerun", "+model=unit", "model.dim=8", "mesh=2x2"),
        *("mesh.elastic=true", "mesh.elastic_dim=replicate", "train.steps=4", f"hydra.run.dir={run}"),
        cwd=tmp_path,
        prog=[TORCHRUN],
        timeout=180,
    )
    out = r.stdout + r.stderr
    line = (
        "composerun: error: mesh.elastic=true: a world of 1 ranks is not a multiple of the dims that stay (shard=2 = 2)"
    )
    assert r.returncode != 0 and out.count(line) == 1, out
    assert "exitcode: 2" in out
    assert sorted(p for p in (run / "checkpoints").rglob("*") if p.is_file()) == files
    assert all(p.read_bytes() == data for p, data in before.items()), "the refused run changed the checkpoint"
