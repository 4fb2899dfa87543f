"""SLURM through hydra-submitit-launcher, without SLURM: the node-list parser, the launch
parameters each node derives from its environment, the shipped `hydra/launcher=slurm` config
as Hydra composes it, and the sbatch file submitit would submit for it (nothing is submitted:
the executor's submission is intercepted before sbatch would run)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import cli, compose
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.utils import instantiate
from omegaconf import OmegaConf

from composerun.cli import quote_mesh_choices
from composerun.config.schema import LaunchConfig
from composerun.errors import ConfigError
from composerun.launch.agent import RANGE_RESTARTS, _rendezvous
from composerun.launch.slurm import Nodes, expand_nodelist, first_task, nodes_from_env, parse_nodelist, rdzv_port

# the second task of `srun` over a two-node job, as submitit starts it
JOB = {
    "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_PROCID": "1",
}  # fmt: skip


# --- node lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04],other", ["node01", "node02", "node03", "node04", "other"]),
        ("gpu[8-11,20]", ["gpu8", "gpu9", "gpu10", "gpu11", "gpu20"]),
        ("a1,b2", ["a1", "b2"]),
        ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
        ("cn[1-2]-ib,login", ["cn1-ib", "cn2-ib", "login"]),
    ],
)
def test_nodelist_expands_like_scontrol(nodelist: str, hosts: list[str]) -> None:
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[4-2]", "node[a-c]", "[01-02]", "node[01-02"])
def test_unreadable_nodelist_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        parse_nodelist(bad)


def test_scontrol_is_asked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where SLURM's tools are installed, their expansion wins (it knows every form)."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames weird{1}" ] && printf "h1\\nh2\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert expand_nodelist("weird{1}") == ["h1", "h2"]
    assert expand_nodelist("n[1-2]") == ["n1", "n2"]  # scontrol failed: the parser's answer


# --- what each node derives from its environment -----------------------------------------------


def test_one_node_outside_slurm_launches_as_before() -> None:
    assert nodes_from_env(LaunchConfig(nodes=1), 8, env={}) is None
    # the shell of a two-node allocation (salloc), no step: one node, as typed
    assert (
        nodes_from_env(LaunchConfig(nodes=1), 8, env={k: v for k, v in JOB.items() if k != "SLURM_STEP_NUM_NODES"})
        is None
    )
    one = _rendezvous(LaunchConfig(nodes=1), 8)
    assert {k: v for k, v in one.items() if k != "run_id"} == {
        "min_nodes": 1, "max_nodes": 1, "nproc_per_node": 8, "rdzv_endpoint": "localhost:0", "max_restarts": 0,
        "rdzv_configs": {},
    }  # fmt: skip


def test_two_node_job_meets_on_its_first_host() -> None:
    nodes = nodes_from_env(LaunchConfig(nodes=2, rdzv_port=29400), 8, env=JOB)
    assert nodes == Nodes(count=2, min_count=2, nproc_per_node=4, rdzv_endpoint="gpu07:29400", run_id="4242")


def test_rendezvous_of_a_two_node_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_ranks' LaunchConfig arguments inside the job: N nodes exactly, world/N ranks here."""
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    assert _rendezvous(LaunchConfig(nodes=2), 4) == {
        "min_nodes": 2, "max_nodes": 2, "nproc_per_node": 2, "rdzv_endpoint": f"gpu07:{20000 + 4242}", "run_id": "4242",
        "max_restarts": 0, "rdzv_configs": {"is_host": False},  # (the second task: the first one hosts the store)
    }  # fmt: skip
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert _rendezvous(LaunchConfig(nodes=2), 4)["rdzv_configs"] == {"is_host": True}


def test_node_range_takes_any_count_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.nodes=4 launch.min_nodes=2 (SLURM's --nodes=2-4): a step over 3 nodes is fine,
    each node still runs mesh size / launch.nodes ranks, and the agents take 2 to 4 nodes with
    restarts (RANGE_RESTARTS unless launch.max_restarts says)."""
    three = {**JOB, "SLURM_STEP_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    got = nodes_from_env(LaunchConfig(nodes=4, min_nodes=2, rdzv_port=29400), 8, env=three)
    assert got == Nodes(count=4, min_count=2, nproc_per_node=2, rdzv_endpoint="gpu07:29400", run_id="4242")
    for key, value in three.items():
        monkeypatch.setenv(key, value)
    lcfg = LaunchConfig(nodes=4, min_nodes=2, rdzv_conf={"last_call_timeout": 3})
    assert _rendezvous(lcfg, 8) == {
        "min_nodes": 2, "max_nodes": 4, "nproc_per_node": 2, "rdzv_endpoint": f"gpu07:{20000 + 4242}", "run_id": "4242",
        "max_restarts": RANGE_RESTARTS, "rdzv_configs": {"last_call_timeout": 3, "is_host": False},
    }  # fmt: skip
    assert _rendezvous(LaunchConfig(nodes=4, min_nodes=2, max_restarts=7), 8)["max_restarts"] == 7
    assert _rendezvous(LaunchConfig(nodes=3, min_nodes=3), 6)["max_restarts"] == 0  # (no range: as launch.nodes)


def test_port_follows_the_job_id_unless_given() -> None:
    assert rdzv_port("4242", None) == 24242
    assert rdzv_port("123456_7", None) == 20000 + 1234567 % 20000  # an array task
    assert rdzv_port("4242", 29500) == 29500


@pytest.mark.parametrize(
    "lcfg, world, env, message",
    [
        ({"nodes": 1}, 8, JOB, r"this SLURM step runs on 2 node\(s\) \(SLURM_STEP_NUM_NODES\) but launch.nodes=1"),
        ({"nodes": 1}, 1, JOB, r"this SLURM step runs on 2 node"),
        ({"nodes": 2}, 8, {**JOB, "SLURM_STEP_NUM_NODES": "1"}, r"runs on 1 node\(s\) .* but launch.nodes=2"),
        ({"nodes": 2}, 8, {}, r"launch.nodes=2 starts ranks on several nodes only inside a SLURM job"),
        ({"nodes": 2}, 3, {**JOB}, r"a mesh of 3 ranks cannot be split evenly over launch.nodes=2"),
        (
            {"nodes": 4, "min_nodes": 3},
            8,
            JOB,
            r"runs on 2 node\(s\) \(SLURM_STEP_NUM_NODES\) but launch.min_nodes=3 to launch.nodes=4",
        ),
        ({"nodes": 2, "min_nodes": 1}, 8, {**JOB, "SLURM_STEP_NUM_NODES": "3"}, r"runs on 3 node\(s\)"),
    ],
)
def test_inconsistent_node_counts_are_config_errors(lcfg: dict, world: int, env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        nodes_from_env(LaunchConfig(**lcfg), world, env=env)


def test_uneven_launch_nodes_fail_at_composition() -> None:
    with pytest.raises(ConfigError, match="launch.nodes=3: must split the mesh's 8 ranks evenly over the nodes"):
        compose("+model=unit", "mesh=2x4", "launch.nodes=3")
    assert compose("+model=unit", "mesh=2x4", "launch.nodes=2").launch.nodes == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["launch.min_nodes=1"],
            r"^launch.min_nodes=1 with launch.nodes=2 runs on fewer nodes .* add mesh.elastic=true",
        ),
        (
            ["launch.min_nodes=3", "mesh.elastic=true"],
            r"^launch.min_nodes=3: a node range is 1 <= launch.min_nodes <= ",
        ),
        (
            ["launch.min_nodes=0", "mesh.elastic=true"],
            r"^launch.min_nodes=0: a node range is 1 <= launch.min_nodes <= ",
        ),
        (["launch.max_restarts=-1"], r"^launch.max_restarts=-1: must be 0 or more"),
        (["launch.rdzv_conf={last_call: 3}"], r"^launch.rdzv_conf.last_call: not a setting of torch's rendezvous"),
    ],
)
def test_bad_node_ranges_fail_at_composition(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose("+model=unit", "mesh=2x2", "launch.nodes=2", *overrides)


def test_a_range_the_mesh_rule_cannot_take_fails_at_composition() -> None:
    """Every world of the range must be one mesh.elastic's rule takes, said before any rank
    starts: 4 nodes of one rank each on 2x2 keep the shard dim (2), so one node left cannot go
    on (and three cannot either: the first count that fails is named, from the top)."""
    with pytest.raises(ConfigError, match=r"^launch.min_nodes=1: with 3 of launch.nodes=4 nodes left \(1 ranks each\), "
                       r"mesh.elastic=true: a world of 3 ranks is not a multiple of the dims that stay \(shard=2 = 2\)"):  # fmt: skip
        compose("+model=unit", "mesh=2x2", "launch.nodes=4", "launch.min_nodes=1", "mesh.elastic=true")
    # the global batch: 8 samples in micro-batches of 1 on 4x2 cannot be kept by 6 replicas (3 nodes left)
    range_4x2 = ("+model=unit", "mesh.shape=[4,2]", "launch.nodes=4", "launch.min_nodes=2", "mesh.elastic=true")
    with pytest.raises(ConfigError, match=r"with 3 of launch.nodes=4 nodes left \(2 ranks each\), mesh.elastic=true: a "
                       r"world of 6 ranks has 6 data-parallel replicas, and data.batch_size=8 is not a whole"):  # fmt: skip
        compose(*range_4x2, "data.batch_size=8")
    # micro-batches of 1 in 3 per step: 24 = 8 x 3 = 6 x 4 = 4 x 6
    assert compose(*range_4x2, "data.batch_size=24", "train.grad_accum=3").launch.min_nodes == 2
    ok = compose("+model=unit", "mesh=2x2", "launch.nodes=2", "launch.min_nodes=1", "mesh.elastic=true")
    assert (ok.launch.min_nodes, ok.launch.nodes, ok.launch.max_restarts) == (1, 2, None)


def test_first_task_writes_the_run_files() -> None:
    assert first_task({}) and first_task({"SLURM_PROCID": "0"})
    assert not first_task(JOB)


# --- the shipped launcher config and the sbatch file it makes ----------------------------------


def compose_with_hydra(*overrides: str) -> Any:
    with initialize_config_module(config_module="composerun.configs", version_base="1.3"):
        return hydra_compose("train", overrides=quote_mesh_choices(list(overrides)), return_hydra_config=True)


def test_slurm_launcher_config_follows_the_mesh(tmp_path: Path) -> None:
    cfg = compose_with_hydra(
        "hydra/launcher=slurm", "+model=unit", "mesh.shape=[2,8]", "launch.nodes=2", f"hydra.sweep.dir={tmp_path}"
    )
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm"
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert params["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    want = {"nodes": 2, "tasks_per_node": 1, "gpus_per_node": 8, "cpus_per_task": 32, "timeout_min": 60,
            "signal_delay_s": 120, "max_num_timeout": 0, "submitit_folder": f"{tmp_path}/.submitit/%j"}  # fmt: skip
    assert {k: params[k] for k in want} == want


def sbatch_text(cfg: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """What the launcher would submit: its own code configures submitit's executor; the
    submission is caught at `map_array`, and the executor writes its sbatch file text."""
    import submitit

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:/usr/bin:/bin")
    caught: list[Any] = []

    def no_submission(executor: Any, fn: Any, *iterables: Any) -> list:
        caught.append(executor)
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", no_submission)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    assert launcher.launch([["train.seed=1"]], initial_job_idx=0) == []
    (executor,) = caught
    slurm = executor._executor
    return slurm._make_submission_file_text(slurm._submitit_command_str, "test")


def test_sbatch_asks_for_one_task_per_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_with_hydra(
        "hydra/launcher=slurm", "+model=unit", "mesh.shape=[2,8]", "launch.nodes=2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=240",
    )  # fmt: skip
    text = sbatch_text(cfg, monkeypatch, tmp_path)
    flags = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for want in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=240",
        "#SBATCH --partition=gpu",
        "#SBATCH --job-name=composerun",
    ]:
        assert want in flags, f"{want} not in:\n{text}"
    # srun runs submitit's entry point once per task, i.e. once per node
    (command,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert re.search(r"-m submitit\.core\._submit \S*sweep/\.submitit/%j$", command), command
    # no node range: SLURM ends the job when a node fails (the run cannot go on without it)
    assert not [f for f in flags if "no-kill" in f or "--nodes=" in f and f != "#SBATCH --nodes=2"], flags
    assert "--no-kill" not in command


def test_sbatch_of_a_node_range_keeps_the_job_on_a_node_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch.min_nodes: SLURM may start the job on fewer nodes (`--nodes=MIN-MAX`), and neither
    the job (sbatch) nor its step (srun) is ended when a node fails (`--no-kill`): the other
    nodes' tasks go on, and their agents restart the ranks without it."""
    cfg = compose_with_hydra(
        "hydra/launcher=slurm", "+model=unit", "mesh.shape=[2,8]", "launch.nodes=2", "launch.min_nodes=1",
        "mesh.elastic=true", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    text = sbatch_text(cfg, monkeypatch, tmp_path)
    flags = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for want in [
        "#SBATCH --nodes=1-2",
        "#SBATCH --no-kill",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
    ]:
        assert want in flags, f"{want} not in:\n{text}"
    assert [f for f in flags if f.startswith("#SBATCH --nodes")] == ["#SBATCH --nodes=1-2"], flags
    (command,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert re.match(
        r"srun --unbuffered --output \S+ --error \S+ --no-kill \S+ -u -m submitit\.core\._submit ", command
    ), command


def test_cpu_partition_asks_for_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_with_hydra(
        "hydra/launcher=slurm", "+model=unit", "mesh=4", "launch.nodes=2", "launch.cpus_per_rank=2",
        "hydra.launcher.gpus_per_node=null", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    flags = [ln for ln in sbatch_text(cfg, monkeypatch, tmp_path).splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --cpus-per-task=4" in flags and "#SBATCH --nodes=2" in flags
    assert not [f for f in flags if "gpu" in f], flags


# --- the CLI, as a user types it (nothing reaches SLURM) -----------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    "overrides, line",
    [
        (["launch.nodes=3"], "a mesh of 8 ranks cannot be split evenly over launch.nodes=3"),
        (
            ["launch.nodes=2", "launch.min_nodes=1"],
            "launch.min_nodes=1 with launch.nodes=2 runs on fewer nodes than the mesh's: add mesh.elastic=true "
            "(the mesh for the nodes left: docs/clusters.md), or leave launch.min_nodes out",
        ),
    ],
)
def test_bad_node_counts_fail_before_submission(tmp_path: Path, overrides: list[str], line: str) -> None:
    r = cli("-m", "hydra/launcher=slurm", "+model=unit", "mesh=2x4", *overrides, "hydra.sweep.dir=sweep",
            cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == f"composerun: error: {line}"
    assert not (tmp_path / "sweep").exists()


@pytest.mark.e2e
def test_slurm_launcher_without_slurm_is_one_line(tmp_path: Path) -> None:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}  # no srun here
    r = cli("-m", "hydra/launcher=slurm", "+model=unit", "mesh=2", "launch.nodes=2", "hydra.sweep.dir=sweep",
            cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert line.startswith("composerun: error: hydra/launcher=slurm submits to SLURM, but srun is not on the PATH")


@pytest.mark.e2e
def test_two_tasks_of_a_slurm_job_train_one_run(tmp_path: Path) -> None:
    """What submitit runs on each of two nodes, on loopback: two `composerun` processes with
    the environment SLURM gives each task.  Each starts 2 ranks; the agents meet on the job's
    first host (here localhost) and train one 4-rank run."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["+model=unit", "model.dim=8", "mesh=2x2", "launch.nodes=2", f"launch.rdzv_port={port}", "train.steps=2",
            "hydra.run.dir=run", "metrics.progress=false"]  # fmt: skip
    job = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "localhost"}
    prog = str(Path(sys.executable).with_name("composerun"))
    procs = [
        subprocess.Popen(
            [prog, *args],
            cwd=tmp_path,
            env={**os.environ, **job, "SLURM_PROCID": str(task), "PYTHONWARNINGS": "ignore"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for task in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert f"2 nodes: 2 ranks on this one, rendezvous at localhost:{port}, id 4242" in out
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 4 and summary["steps"] == 2
    assert {p.name for p in run.glob("rank*.log")} == {f"rank{r}.log" for r in range(4)}
    agents = run / "torchelastic"
    assert len([p for p in agents.iterdir() if p.is_dir()]) == 2  # one agent per node
    assert (agents / "started-4242").is_file()  # rank 0's mark: ranks of job 4242 that start again resume
