"""The estimate's collectives priced by the topology (issue 30, item 1): the mesh laid out on
nodes of plan.gpus_per_node GPUs (rank r on node r // gpus_per_node), each collective priced
by the dims it spans (NVLink inside a node, the NICs across nodes), plan.json's topology.

The seconds are worked out here from plan.json's bytes and calls and the bandwidths and
latencies parallel/topology.py states, not by calling its pricing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import cli, compose

from composerun.devices import DEVICES
from composerun.parallel import topology as topo
from composerun.parallel.plan import format_table
from composerun.parallel.planner import plan_offline

H100 = DEVICES["H100"]
NVLINK = H100.link_gbps * 1e9 / 8 * topo.INTRA_NODE_EFFICIENCY  # bytes/s NCCL moves per GPU
NIC = 400e9 / 8 * topo.INTER_NODE_EFFICIENCY
PLANNING_8B = [
    "+model=llama3_8b", "mesh.shape=[8,8]", "sharding=fsdp_blocks_ac", "plan=true", "plan.device=H100",
    "data.batch_size=64", "sharding.param_dtype=bfloat16",
]  # fmt: skip


ONE_NODE = [
    "+model=llama3_debug", "mesh=8", "sharding=fsdp_blocks", "data.batch_size=8", "sharding.param_dtype=bfloat16",
    "plan=true", "plan.device=H100", "plan.search_batch=false",
]  # fmt: skip


def ring_s(kind: str, nbytes: int, calls: int, ranks: int, nodes: int = 1) -> float:
    """One kind of collective over groups of `ranks` spread evenly over `nodes`, by hand: a ring
    inside the node at NVLink, and across nodes a ring over the nodes through the NICs of the
    group's ranks on each node (the slower of the two bounds it); plus the stated latencies."""
    twice = 2 if kind.endswith("all_reduce") else 1
    per_node = ranks // nodes
    inside = twice * (per_node - 1) / per_node * nbytes / NVLINK
    across = twice * (nodes - 1) / nodes * nbytes / (per_node * NIC)
    steps = twice * ((per_node - 1) * topo.INTRA_NODE_STEP_S + (nodes - 1) * topo.INTER_NODE_STEP_S)
    return max(inside, across) + calls * (topo.COLLECTIVE_LATENCY_S + steps)


def nvlink_as_before(plan: dict) -> float:
    """The estimate before topologies: every payload over one GPU's NVLink line rate, all-reduce twice."""
    return sum(v * (2 if k.endswith("all_reduce") else 1) for k, v in plan["comm_per_step"].items()) / (
        H100.link_gbps * 1e9 / 8
    )


@pytest.mark.parametrize(
    ("mesh", "per_node", "dims", "want"),
    [
        ("8x8", 8, ["shard"], (8, 1, 8, 8)),  # the inner dim stays inside a node
        ("8x8", 8, ["replicate"], (8, 8, 1, 1)),  # the outer one crosses 8 nodes, one rank on each
        ("8x8", 8, ["replicate", "shard"], (64, 8, 8, 8)),  # FSDP over every rank: 8 nodes, 8 on each
        ("2x4", 4, ["shard"], (4, 1, 4, 4)),
        ("2x4", 4, ["replicate"], (2, 2, 1, 1)),
        ("16", 8, ["shard"], (16, 2, 8, 8)),  # a 1-D mesh of 16 spans 2 nodes
        ("3x4", 8, ["replicate"], (3, 2, 1, 2)),  # rows that do not fill nodes: {0, 4} on node 0, 8 on node 1
    ],
)
def test_the_mesh_laid_out_on_nodes(mesh: str, per_node: int, dims: list[str], want: tuple) -> None:
    shape = mesh.replace("x", ",")
    cfg = compose("+model=composite", f"mesh.shape=[{shape}]", f"plan.gpus_per_node={per_node}", "plan=true")
    s = topo.span(cfg, dims)
    assert (s.size, s.nodes, s.fewest, s.most) == want
    assert topo.nodes_of(cfg) == -(-math.prod(cfg.mesh.shape) // per_node)


def test_hsdp_across_two_nodes_priced_by_hand() -> None:
    """HSDP on 2x4 with 4 GPUs per node: all-gathers and reduce-scatters over `shard` inside a
    node at NVLink, the all-reduce over `replicate` across 2 nodes through one NIC per rank."""
    plan = plan_offline(
        compose("+model=composite", "mesh=2x4", "sharding=hsdp", "plan.gpus_per_node=4", "plan.device=H100")
    )[0]
    t = plan["topology"]
    assert (t["gpus_per_node"], t["nodes"], t["intra_node_gbps"], t["inter_node_gbps"]) == (4, 2, 3600, 400)
    assert t["dims"]["shard"] == {"size": 4, "nodes": 1, "ranks_per_node": 4, "link": "intra_node", "gbps": 3600}
    assert t["dims"]["replicate"] == {"size": 2, "nodes": 2, "ranks_per_node": 1, "link": "inter_node", "gbps": 400}
    step = plan["estimate"]["step_time"]
    total = 0.0
    for u, got in zip(plan["units"], step["comm_per_unit_s"], strict=True):
        spans = u["comm_spans"]
        if not spans:  # (the root: its children own every parameter)
            assert not any(u["comm_per_step"].values()) and not any(got[f"{k}_s"] for k in topo.KINDS)
            continue
        assert spans["all_gather"]["dims"] == spans["reduce_scatter"]["dims"] == ["shard"]
        assert spans["all_reduce"] == {"dims": ["replicate"], "calls": 1}
        want = {
            "all_gather_s": ring_s("all_gather", u["comm_per_step"]["all_gather"], spans["all_gather"]["calls"], 4),
            "reduce_scatter_s": ring_s("reduce_scatter", u["comm_per_step"]["reduce_scatter"], 1, 4),
            "all_reduce_s": ring_s("all_reduce", u["comm_per_step"]["all_reduce"], 1, 2, nodes=2),
        }
        assert got.pop("fqn") == u["fqn"] and got == pytest.approx(want)
        total += sum(want.values())
    assert step["comm_s"] == pytest.approx(total)
    assert step["step_s"] == pytest.approx(step["compute_s"] + step["exposed_comm_s"])  # (step_time.py: what overlaps)
    assert step["topology"] == t


def test_a_single_node_mesh_is_a_ring_at_nvlink() -> None:
    """mesh=8 on an H100: one node; every collective a ring over 8 ranks at NVLink, whose
    bandwidth term is the old estimate's (every payload at the line rate) x (8-1)/8 / the
    stated efficiency."""
    plan = plan_offline(compose(*ONE_NODE))[0]
    assert plan["topology"]["nodes"] == 1 and plan["topology"]["dims"]["shard"]["link"] == "intra_node"
    calls = {k: sum(u["comm_spans"].get(k, {}).get("calls", 0) for u in plan["units"]) for k in topo.KINDS}
    latency = sum(n * (topo.COLLECTIVE_LATENCY_S + 7 * topo.INTRA_NODE_STEP_S) for n in calls.values())
    bandwidth = sum(v * 7 / 8 / NVLINK for v in plan["comm_per_step"].values())  # (no all-reduce here)
    step = plan["estimate"]["step_time"]
    assert step["comm_s"] == pytest.approx(bandwidth + latency)
    assert bandwidth == pytest.approx(nvlink_as_before(plan) * 7 / 8 / topo.INTRA_NODE_EFFICIENCY)
    line = format_table(plan).splitlines()[-1]
    assert line == "topology: 1 node of 8 GPUs; shard (8) inside a node at 3600 Gbit/s"


def test_the_readmes_8b_on_8_nodes() -> None:
    """docs/planning.md's 8B command on mesh 8x8 (8 nodes of 8): `replicate` crosses nodes. FSDP
    over all 64 ranks has 8 of them on each node, whose 8 NICs share the ring over the nodes:
    NVLink, not the NICs, bounds it (about 1.1x the old NVLink-only figure, with latency 1.2x).
    Where a group has one rank per node (plan.gpus_per_node=1) each rank's own NIC carries it:
    about 9x the old figure.  (The plan only: the estimate's step time prices its collectives
    with the same comm_time, as the two tests above check.)"""
    cfg = compose(*PLANNING_8B, "plan.estimate=false")
    plan = plan_offline(cfg)[0]
    t = plan["topology"]
    assert t["nodes"] == 8 and t["dims"]["replicate"]["link"] == "inter_node" and t["dims"]["replicate"]["nodes"] == 8
    assert t["dims"]["shard"]["link"] == "intra_node"
    assert t["data_parallel"] == {
        "dims": ["replicate", "shard"], "size": 64, "nodes": 8, "ranks_per_node": 8, "link": "inter_node", "gbps": 400,
    }  # fmt: skip
    step = topo.comm_time(plan, cfg, H100)
    want = 0.0
    for u in plan["units"]:
        for kind, where in u["comm_spans"].items():
            assert where["dims"] == ["replicate", "shard"]
            want += ring_s(kind, u["comm_per_step"][kind], where["calls"], 64, nodes=8)
    assert step["comm_s"] == pytest.approx(want)
    assert 1.05 < step["comm_s"] / nvlink_as_before(plan) < 1.35
    lines = format_table(plan).splitlines()
    assert lines[-1] == (
        "topology: 8 nodes of 8 GPUs; replicate (8) across 8 nodes at 400 Gbit/s per GPU NIC; "
        "shard (8) inside a node at 3600 Gbit/s; replicate+shard (64) across 8 nodes, 8 per node sharing their 400 Gbit/s NICs"
    )
    # one GPU per node: 64 nodes, every hop of the ring through one NIC
    alone = topo.comm_time(plan, compose(*PLANNING_8B, "plan.gpus_per_node=1"), DEVICES["H100"])
    assert alone["comm_s"] == pytest.approx(
        sum(
            ring_s(k, u["comm_per_step"][k], w["calls"], 64, nodes=64)
            for u in plan["units"]
            for k, w in u["comm_spans"].items()
        )
    )
    assert alone["comm_s"] / nvlink_as_before(plan) > 9


@pytest.mark.e2e
@pytest.mark.parametrize(("key", "value"), [("gpus_per_node", "0"), ("internode_gbps", "-0.5")])
def test_a_bad_topology_key_is_one_line(tmp_path: Path, key: str, value: str) -> None:
    r = cli("+model=composite", "mesh=2", "plan=true", f"plan.{key}={value}", "hydra.run.dir=p", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"composerun: error: plan.{key}={value}: must be")
    assert not (tmp_path / "p").exists()
