"""`plan=true`: the plan of any mesh, computed in this process on torch's fake process group.

For each rank whose shards can differ, the model is built on the meta device (no memory,
no initialisation), the policy is applied exactly as a real run applies it, on a fake
process group of the requested world size in which this process plays that rank; its
local shard shapes are read back.  Ranks whose coordinates along every sharded mesh dim
agree hold the same shards, so a 512-rank HSDP mesh (8x64) needs 64 such passes, not 512.
The rows then go through the same `assemble_report` a real run's gathered rows go
through, so plan.json is byte-for-byte the file a real run of the config writes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from composerun import _torch_compat as compat
from composerun.config import mesh_dim_names
from composerun.models import build_model
from composerun.plan import _rank_view, assemble_report, local_rows, optim_state_factor
from composerun.sharding import apply_policy, effective_rules, make_plan


def _sharded_dims(cfg: dict[str, Any]) -> list[int]:
    """Indices of the mesh dims some fully_shard unit shards over; shards differ along these only."""
    shape = cfg["mesh"]["shape"]
    names = mesh_dim_names(shape, cfg["mesh"].get("dim_names"))
    with torch.device("meta"):
        plan = make_plan(build_model(cfg["model"]), effective_rules(cfg["sharding"]))
    dims: set[int] = set()
    for u in plan.values():
        if "fully_shard" not in u.apis:
            continue
        if u.mesh_dims is None or len(u.mesh_dims) == 1:
            # one data-parallel dim: the whole (flattened) mesh, or the one dim named
            dims |= set(range(len(shape))) if u.mesh_dims is None else {names.index(u.mesh_dims[0])}
        else:
            dims.add(names.index(u.mesh_dims[-1]))  # HSDP shards over the last named dim
    return sorted(dims)


def representatives(cfg: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(one rank per distinct shard coordinate, and for every rank the index of its representative)."""
    shape = cfg["mesh"]["shape"]
    dims = _sharded_dims(cfg)
    coords = np.stack(np.unravel_index(np.arange(math.prod(shape)), shape), axis=1)[:, dims]
    index: dict[tuple[int, ...], int] = {}  # shard coordinate -> its representative's index
    firsts: list[int] = []
    of_rank = []
    for rank, c in enumerate(map(tuple, coords.tolist())):
        if c not in index:
            index[c] = len(firsts)
            firsts.append(rank)
        of_rank.append(index[c])
    return firsts, of_rank


def _rows_as(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Apply the policy as `rank` of the mesh on a fake process group; this rank's rows."""
    shape = cfg["mesh"]["shape"]
    compat.init_fake_process_group(rank, math.prod(shape))
    try:
        mesh = init_device_mesh(
            "cpu", tuple(shape), mesh_dim_names=tuple(mesh_dim_names(shape, cfg["mesh"].get("dim_names")))
        )
        with torch.device("meta"):
            model = build_model(cfg["model"])
        plan = apply_policy(model, cfg["sharding"], mesh)
        return local_rows(model, plan, optim_state_factor(cfg["optim"]["_target_"], cfg["optim"].get("kwargs")))
    finally:
        dist.destroy_process_group()


def plan_offline(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plan.json's content, facts about the planning itself)."""
    if dist.is_initialized():
        raise RuntimeError("plan=true needs a process without a process group (the fake group becomes the default)")
    t0 = time.perf_counter()
    reps, of_rank = representatives(cfg)
    rows = [_rows_as(r, cfg) for r in reps]
    every = [_rank_view(rows[of_rank[r]]) for r in range(len(of_rank))]
    report = assemble_report(rows[0], every, cfg)
    return report, {"planned_ranks": len(reps), "plan_s": time.perf_counter() - t0}
