"""Several nodes inside a SLURM job: what each node's elastic agent needs from the environment.

With `hydra/launcher=slurm` (hydra-submitit-launcher, one task per node), the task function
runs once on every node of the job.  Each node then starts its own ranks through the same
elastic launcher as on one node, with a c10d rendezvous on the job's first host: the agent
of the job's first task, on that host, hosts the rendezvous store, the others connect to it.  The rendezvous id is the job id, so the
nodes of one job meet and nothing else does.

With a node range (launch.min_nodes to launch.nodes, mesh.elastic=true) the agents form a
group of any count in the range and restart their ranks when a node is lost (or joins): the
ranks then take the mesh of the new world (rank.py).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from composerun.config.schema import LaunchConfig
from composerun.errors import ConfigError


@dataclass(frozen=True)
class Nodes:
    """The multi-node part of torch's LaunchConfig."""

    count: int  # the most nodes (launch.nodes)
    min_count: int  # the fewest the run goes on with (launch.min_nodes; count without a range)
    nproc_per_node: int
    rdzv_endpoint: str
    run_id: str


# One host group of a SLURM node list: a name with [..] ranges, up to a top-level comma.
_GROUP = re.compile(r"([^,\[]+(?:\[[^\]]*\][^,\[]*)*)(?:,|$)")


def _expand_ranges(spec: str) -> list[str]:
    """`01-03,7` -> 01 02 03 7 (zero padding kept, as SLURM writes it)."""
    out = []
    for part in spec.split(","):
        low, sep, high = part.partition("-")
        if not sep:
            out.append(low)
            continue
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ValueError(f"bad range '{part}'")
        out += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    return out


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed node list (`gpu[01-03,07],login1`, `r[1-2]n[1-2]`) into host
    names, in SLURM's order.  Used where `scontrol` is not on the PATH."""
    hosts: list[str] = []
    pos = 0
    while pos < len(nodelist):
        m = _GROUP.match(nodelist, pos)
        if not m or not m.group(1):
            raise ConfigError(f"SLURM_JOB_NODELIST='{nodelist}': cannot read it as a SLURM node list")
        pieces = re.split(r"\[([^\]]*)\]", m.group(1))  # name, ranges, name, ranges, ..., name
        try:
            choices = [[p] if i % 2 == 0 else _expand_ranges(p) for i, p in enumerate(pieces)]
        except ValueError as e:
            raise ConfigError(f"SLURM_JOB_NODELIST='{nodelist}': {e}") from None
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
        pos = m.end()
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """`scontrol show hostnames` where SLURM's own tools are installed, else our parser."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    return parse_nodelist(nodelist)


def rdzv_port(job_id: str, given: int | None) -> int:
    """The given port, else one derived from the job id: jobs of a sweep (a job array) can
    share a first host, and a fixed port would let the second one fail to bind."""
    if given:
        return given
    digits = re.sub(r"\D", "", job_id)
    return 20000 + int(digits or 0) % 20000


def nodes_from_env(lcfg: LaunchConfig, world: int, env: Mapping[str, str] | None = None) -> Nodes | None:
    """The multi-node launch parameters, or None to start every rank on this node.

    `launch.nodes` decides (or the range launch.min_nodes to launch.nodes).  A SLURM step
    (srun, as submitit starts one task per node) over another number of nodes is an error:
    with fewer, the agents would wait for nodes that never come; with more, each task would
    start a whole run of its own in the same run directory.  The step's count, not the
    allocation's (SLURM_NNODES), is compared, so that a one-node run typed in the shell of a
    larger allocation still works.  Each node runs mesh size / launch.nodes ranks, however many
    nodes the range gave."""
    env = os.environ if env is None else env
    nodes, low = lcfg.nodes, lcfg.min_nodes or lcfg.nodes
    step_nodes = int(env.get("SLURM_STEP_NUM_NODES") or 0)  # set by srun in each task of a step
    if step_nodes and not low <= step_nodes <= nodes:
        want = f"launch.nodes={nodes}" if low == nodes else f"launch.min_nodes={low} to launch.nodes={nodes}"
        raise ConfigError(
            f"this SLURM step runs on {step_nodes} node(s) (SLURM_STEP_NUM_NODES) but {want}: "
            "composerun needs one task on each node of the job (hydra/launcher=slurm asks SLURM for that)"
        )
    if nodes == 1:
        return None
    if "SLURM_JOB_ID" not in env or "SLURM_JOB_NODELIST" not in env:
        raise ConfigError(
            f"launch.nodes={nodes} starts ranks on several nodes only inside a SLURM job (hydra/launcher=slurm); "
            "elsewhere start one torchrun per node (docs/clusters.md)"
        )
    if world % nodes:
        raise ConfigError(f"a mesh of {world} ranks cannot be split evenly over launch.nodes={nodes}")
    host = expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
    port = rdzv_port(env["SLURM_JOB_ID"], lcfg.rdzv_port)
    return Nodes(nodes, low, world // nodes, f"{host}:{port}", env["SLURM_JOB_ID"])


def first_task(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the job's first task (or not in a SLURM step at all): the one
    that writes the run directory's files before the ranks start."""
    env = os.environ if env is None else env
    return int(env.get("SLURM_PROCID") or 0) == 0
