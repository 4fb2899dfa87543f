"""The mesh laid out on nodes, and what each collective of a step costs on it (the estimate's
step time, parallel/step_time.py).

Ranks are numbered row-major on the mesh (the last dim innermost) and fill nodes of
`plan.gpus_per_node` GPUs in rank order, as torchrun and SLURM number them: rank r runs on
node r // gpus_per_node.  A collective over some mesh dims runs in groups of the ranks that
differ only in those dims; a group stays inside one node or spans several, with some of its
ranks on each.

Each group is priced as NCCL's ring runs it, its bandwidth term plus its latency term:

- inside a node: a ring over its G ranks on the intra-node link (`plan.link_gbps`, default
  the device's NVLink): each rank sends (G-1)/G of an all-gather's or reduce-scatter's
  payload, 2(G-1)/G of an all-reduce's.
- across n nodes, k of its ranks on each: every GPU has its own NIC (`plan.internode_gbps`,
  default the device's), and the k ranks of a node each carry a k-th of the node's share,
  so the ring over the nodes moves (n-1)/n of the payload (twice that for an all-reduce)
  through k NICs at once.  The hops inside each node run at the same time over NVLink (NCCL
  pipelines its rings in chunks), so the slower of the two bounds the collective.  With one
  rank of the group per node (k = 1: HSDP's replicate dim across nodes) the whole
  (n-1)/n goes through each rank's one NIC; with every GPU of a node in the group (FSDP
  over all ranks) all of the node's NICs share it and NVLink may still be the bound.
- latency: NCCL's own tuning model of a ring (its Simple protocol, the one bulk transfers
  take): a fixed cost per collective and a cost per ring step, smaller on NVLink than
  through the network; all-gather and reduce-scatter take G-1 steps, all-reduce twice that.
  Tensor parallelism's traced collectives come as bytes without a count: bandwidth only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from composerun.config.schema import Config, mesh_dim_names
from composerun.devices import Device, plan_device
from composerun.parallel.rules import TP_DIM, data_parallel_dims

# Bus bandwidth NCCL reaches, as a fraction of the line rate per direction.  NVLink: its
# protocol overhead is about a fifth; nccl-tests' all-gather and reduce-scatter on 8 H100s
# (450 GB/s per direction) level off at 360-370 GB/s, which NCCL's developers give as what
# to expect.  NICs: on 400 Gbit/s InfiniBand (50 GB/s) a healthy node's nccl-tests reach
# 46-48 GB/s per NIC.
INTRA_NODE_EFFICIENCY = 0.80
INTER_NODE_EFFICIENCY = 0.92
# Latency of a ring in NCCL's tuning model (Simple protocol), seconds: once per collective,
# and per ring step over NVLink and over the network.
COLLECTIVE_LATENCY_S = 8.4e-6
INTRA_NODE_STEP_S = 3.4e-6
INTER_NODE_STEP_S = 14e-6

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Span:
    """The groups of a collective over `dims`: their size, and the most nodes one spans;
    `fewest` and `most`: the fewest and most of a group's ranks on one of its nodes."""

    dims: tuple[str, ...]
    size: int
    nodes: int
    fewest: int
    most: int


@dataclass(frozen=True)
class Links:
    """The line rates a collective is priced at, Gbit/s per GPU and direction (None: not known)."""

    intra_gbps: float | None
    inter_gbps: float | None


def links(cfg: Config, device: Device | None) -> Links:
    p = cfg.plan
    return Links(
        p.link_gbps or (device.link_gbps if device else None),
        p.internode_gbps or (device.internode_gbps if device else None),
    )


def nodes_of(cfg: Config) -> int:
    return -(-math.prod(cfg.mesh.shape) // cfg.plan.gpus_per_node)


def span(cfg: Config, dims: list[str] | tuple[str, ...]) -> Span:
    """Where the groups of a collective over `dims` lie (every group looked at: on a mesh
    whose rows do not fill whole nodes they differ)."""
    shape = list(cfg.mesh.shape)
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    axes = [names.index(d) for d in dims]
    size = math.prod(shape[a] for a in axes)
    node = np.arange(math.prod(shape)).reshape(shape) // cfg.plan.gpus_per_node
    rows = np.moveaxis(node, axes, list(range(len(shape) - len(axes), len(shape)))).reshape(-1, size)
    # (group, node) pairs and how many of the group's ranks each node holds
    pairs, counts = np.unique(np.arange(len(rows))[:, None] * (node.max() + 1) + rows, return_counts=True)
    per_group = np.bincount(pairs // (node.max() + 1))
    return Span(tuple(dims), size, int(per_group.max()), int(counts.min()), int(counts.max()))


def collective_s(kind: str, nbytes: float, calls: int, s: Span, at: Links) -> float:
    """Seconds of `calls` collectives of `kind` carrying `nbytes` in all, over groups `s`."""
    if s.size <= 1 or not nbytes:
        return 0.0
    twice = 2 if kind.endswith("all_reduce") else 1
    intra = at.intra_gbps * 1e9 / 8 * INTRA_NODE_EFFICIENCY  # bytes/s
    if s.nodes == 1:
        seconds = twice * (s.size - 1) / s.size * nbytes / intra
        steps = twice * (s.size - 1) * INTRA_NODE_STEP_S
    else:
        nics = s.fewest * at.inter_gbps * 1e9 / 8 * INTER_NODE_EFFICIENCY  # the node with the fewest of them
        across = twice * (1 - s.fewest / s.size) * nbytes / nics  # what that node does not hold comes in
        inside = twice * (s.most - 1) / s.most * nbytes / intra
        seconds = max(across, inside)
        steps = twice * ((s.nodes - 1) * INTER_NODE_STEP_S + (s.most - 1) * INTRA_NODE_STEP_S)
    return seconds + calls * (COLLECTIVE_LATENCY_S + steps)


def comm_time(report: dict[str, Any], cfg: Config, device: Device) -> dict[str, Any]:
    """The step's collectives on `device`: seconds in all, per kind, and per unit in the
    plan's unit order (plan.json's comm_per_step and comm_spans).  A unit's calls of one kind
    carry the same payload each, so one call (the step's first all-gather, its last
    reduce-scatter) takes the unit's seconds / its comm_spans calls."""
    at = links(cfg, device)
    spans: dict[tuple[str, ...], Span] = {}

    def over(dims: list[str]) -> Span:
        if tuple(dims) not in spans:
            spans[tuple(dims)] = span(cfg, dims)
        return spans[tuple(dims)]

    units, per_kind = [], dict.fromkeys(KINDS, 0.0)
    for u in report["units"]:
        row = {"fqn": u["fqn"]}
        for kind in KINDS:
            where = u.get("comm_spans", {}).get(kind)
            s = collective_s(kind, u["comm_per_step"][kind], where["calls"], over(where["dims"]), at) if where else 0.0
            row[f"{kind}_s"] = s
            per_kind[kind] += s
        units.append(row)
    for kind, nbytes in report["comm_per_step"].items():
        if kind.startswith("tp_"):  # tensor parallelism's, traced over the tp dim
            names = mesh_dim_names(cfg.mesh.shape, cfg.mesh.dim_names)
            per_kind[kind] = collective_s(kind, nbytes, 0, over([TP_DIM]), at) if TP_DIM in names else 0.0
    return {"comm_s": sum(per_kind.values()), "per_kind_s": per_kind, "units": units}


def mesh_topology(cfg: Config) -> dict[str, Any]:
    """plan.json's `topology`: the nodes, and for each mesh dim (and each set of dims that a
    data-parallel collective spans) its size, whether its groups stay inside a node or how
    many nodes they cross, and the line rate of the link it is priced at."""
    shape = list(cfg.mesh.shape)
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    at = links(cfg, plan_device(cfg.plan.device) if cfg.plan.device is not None else None)

    def entry(dims: list[str]) -> dict[str, Any]:
        s = span(cfg, dims)
        inside = s.nodes == 1
        return {
            "size": s.size,
            "nodes": s.nodes,
            "ranks_per_node": s.most,
            "link": "intra_node" if inside else "inter_node",
            "gbps": at.intra_gbps if inside else at.inter_gbps,
        }

    dp = data_parallel_dims(names)
    return {
        "gpus_per_node": cfg.plan.gpus_per_node,
        "nodes": nodes_of(cfg),
        "intra_node_gbps": at.intra_gbps,
        "inter_node_gbps": at.inter_gbps,
        "efficiency": {"intra_node": INTRA_NODE_EFFICIENCY, "inter_node": INTER_NODE_EFFICIENCY},
        "dims": {d: entry([d]) for d in names},
        **({"data_parallel": {"dims": dp, **entry(dp)}} if len(dp) > 1 else {}),
    }


def topology_line(t: dict[str, Any]) -> str:
    """What the plan prints of the topology: the nodes, and which dims cross them."""
    nodes, gpn = t["nodes"], t["gpus_per_node"]
    where = [f"{nodes} node{'s' if nodes > 1 else ''} of {gpn} GPU{'s' if gpn > 1 else ''}"]
    groups = {d: e for d, e in t["dims"].items() if e["size"] > 1}
    if "data_parallel" in t:
        groups["+".join(t["data_parallel"]["dims"])] = t["data_parallel"]
    for name, e in groups.items():
        rate = f"{e['gbps']:.0f} Gbit/s" if e["gbps"] else ""  # (known where a device or the links are given)
        if e["link"] == "intra_node":
            where.append(f"{name} ({e['size']}) inside a node" + (f" at {rate}" if rate else ""))
        elif e["ranks_per_node"] > 1:  # a node's ranks of the group each carry a share through their own NIC
            nics = f"their {rate} NICs" if rate else "their NICs"
            where.append(
                f"{name} ({e['size']}) across {e['nodes']} nodes, {e['ranks_per_node']} per node sharing {nics}"
            )
        else:
            where.append(
                f"{name} ({e['size']}) across {e['nodes']} nodes" + (f" at {rate} per GPU NIC" if rate else "")
            )
    return "topology: " + "; ".join(where)


def comm_assumptions(t: dict[str, Any]) -> list[str]:
    """How the step time prices the collectives (its `assumptions`), with this plan's links."""
    eff = t["efficiency"]
    return [
        f"ranks row-major on the mesh, {t['gpus_per_node']} GPUs per node (plan.gpus_per_node): {t['nodes']} node(s)",
        f"inside a node: a ring at {t['intra_node_gbps']:.0f} Gbit/s per GPU (plan.link_gbps) x {eff['intra_node']} "
        "(NCCL's bus bandwidth of the line rate); (G-1)/G of an all-gather or reduce-scatter's payload, all-reduce twice",
        f"across nodes: a ring over the nodes at {t['inter_node_gbps']:.0f} Gbit/s per GPU NIC (plan.internode_gbps) "
        f"x {eff['inter_node']}, a node's NICs sharing its ranks' traffic; (n-1)/n of the payload over n nodes, "
        "all-reduce twice; bounded by the intra-node hops where they are slower",
        f"latency per collective {COLLECTIVE_LATENCY_S * 1e6:.1f} us, per ring step {INTRA_NODE_STEP_S * 1e6:.1f} us "
        f"inside a node and {INTER_NODE_STEP_S * 1e6:.0f} us across (tensor parallelism's collectives: bandwidth only)",
    ]
