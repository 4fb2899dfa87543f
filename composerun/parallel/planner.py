"""`plan=true`: the plan of any mesh, computed in this process on torch's fake process group.

For each distinct shard layout, the model is built on the meta device (no memory, no
initialisation) and the policy applied exactly as a real run applies it, on a fake
process group of the requested world size in which this process plays a rank with that
layout; its local shard shapes are read back.  Ranks that get the same number of rows of
every parameter share a layout, so HSDP on 8x64 with a 100-row model needs two passes
(ranks with 2 rows, ranks with none), not 512.
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
from composerun.config.schema import Config, mesh_dim_names
from composerun.errors import ConfigError
from composerun.models import build_model
from composerun.parallel.apply import apply_policy, tp_mesh
from composerun.parallel.plan import _rank_view, assemble_report, local_rows, optim_state_factor
from composerun.parallel.rules import TP_DIM, assign_units, data_parallel_dims, effective_rules, unit_params
from composerun.parallel.tp_comm import trace_tp_comm

# The largest training clusters hold ~1e5 accelerators; a plan of 1e6 ranks (mesh=1000x1000)
# takes many minutes to plan.
MAX_PLANNED_RANKS = 1 << 20


def _shard_index(rank_coords: np.ndarray, dims: list[str] | None, names: list[str], shape: list[int]) -> np.ndarray:
    """Each rank's shard index in a fully_shard unit's shard group (every rank at once)."""
    if dims is None:  # every data-parallel dim as one (the flattened mesh; `tp` is not one)
        dp = [names.index(d) for d in data_parallel_dims(names)]
        return np.ravel_multi_index(tuple(rank_coords[:, dp].T), [shape[i] for i in dp])
    return rank_coords[:, names.index(dims[-1])]  # 1-D: that dim; HSDP: shards over the last named dim


def _rows_of_dim0(d0: int, n: int) -> list[int]:
    """Rows of dim 0 on each of n shards: FSDP2 splits like torch.chunk (ceil(d0/n) rows per
    shard, the last ones short or empty)."""
    c = -(-d0 // n)
    return [min(c, max(0, d0 - i * c)) for i in range(n)]


def representatives(cfg: Config) -> tuple[list[int], list[int]]:
    """(one rank per distinct shard layout, and for every rank the index of its representative).

    Two ranks hold the same local shapes when every fully_shard unit gives them the same
    number of rows of each parameter; only one of them needs a pass on the fake group.
    The policy matrix tests check the planner against real runs where such groups form."""
    shape = cfg.mesh.shape
    if math.prod(shape) > MAX_PLANNED_RANKS:
        raise ConfigError(
            f"mesh.shape={list(shape)}: {math.prod(shape):,} ranks; plan=true plans meshes of at most "
            f"{MAX_PLANNED_RANKS:,} ranks"
        )
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.adapter, cfg.train.seed)
    sizes = dict(zip(names, shape, strict=True))
    units = assign_units(model, effective_rules(cfg.sharding), sizes)
    coords = np.stack(np.unravel_index(np.arange(math.prod(shape)), shape), axis=1)
    columns = []
    split = _tp_splits_dim0(model, units)
    tp = sizes.get(TP_DIM, 1)
    if split or any("parallelize" in u.apis for u in units.values()):
        columns.append(coords[:, names.index(TP_DIM)])  # tensor parallelism's shards differ by tp rank
    for fqn, params in unit_params(model, units).items():
        u = units.get(fqn)
        if u is None or "fully_shard" not in u.apis:
            continue
        index = _shard_index(coords, u.mesh_dims, names, shape)
        n = int(index.max()) + 1
        for name, p in params:
            d0 = p.shape[0] if p.dim() else 1
            if name in split:  # FSDP splits the rows tensor parallelism left on each tp rank
                local = np.asarray(_rows_of_dim0(d0, tp))[coords[:, names.index(TP_DIM)]]
                table = {d: np.asarray(_rows_of_dim0(d, n)) for d in set(local.tolist())}
                columns.append(np.asarray([table[d][i] for d, i in zip(local.tolist(), index.tolist(), strict=True)]))
            else:
                columns.append(np.asarray(_rows_of_dim0(d0, n))[index])
    keys = map(tuple, np.stack(columns, axis=1).tolist()) if columns else ((),) * len(coords)
    index_of: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    of_rank = []
    for rank, key in enumerate(keys):
        if key not in index_of:
            index_of[key] = len(firsts)
            firsts.append(rank)
        of_rank.append(index_of[key])
    return firsts, of_rank


def _tp_splits_dim0(model: torch.nn.Module, units: dict[str, Any]) -> set[str]:
    """The parameters whose dim 0 tensor parallelism splits: a colwise Linear's weight and
    bias (its output features), a rowwise Embedding's table (its vocabulary rows)."""
    modules = dict(model.named_modules())
    out = set()
    for fqn, u in units.items():
        for sub, spec in u.api_options.get("parallelize", {}).get("styles", {}).items():
            where = f"{fqn}.{sub}" if fqn else sub
            linear = isinstance(modules[where], torch.nn.Linear)
            if (spec["style"] == "colwise") == linear and spec["style"] in ("colwise", "rowwise"):
                out.update(f"{where}.{n}" for n, _ in modules[where].named_parameters(recurse=False))
    return out


def _rows_as(rank: int, cfg: Config, trace: bool = False) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Apply the policy as `rank` of the mesh on a fake process group: this rank's rows, and
    with `trace`, tensor parallelism's collectives per step (traced as a real run traces them)."""
    shape = cfg.mesh.shape
    compat.init_fake_process_group(rank, math.prod(shape))
    try:
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(mesh_dim_names(shape, cfg.mesh.dim_names)))
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.adapter, cfg.train.seed)
        units = apply_policy(model, cfg.sharding, mesh)
        rows = local_rows(model, units, optim_state_factor(cfg.optim._target_, cfg.optim.kwargs))
        return rows, trace_tp_comm(cfg, tp_mesh(mesh)) if trace else {}
    finally:
        dist.destroy_process_group()


def plan_offline(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plan.json's content, facts about the planning itself)."""
    if dist.is_initialized():
        raise RuntimeError("plan=true needs a process without a process group (the fake group becomes the default)")
    t0 = time.perf_counter()
    reps, of_rank = representatives(cfg)
    passes = [_rows_as(r, cfg, trace=i == 0) for i, r in enumerate(reps)]
    rows = [p[0] for p in passes]
    every = [_rank_view(rows[of_rank[r]]) for r in range(len(of_rank))]
    report = assemble_report(rows[0], every, cfg, passes[0][1])
    facts = {"planned_ranks": len(reps), "plan_s": time.perf_counter() - t0}
    if cfg.plan.estimate:
        t1 = time.perf_counter()
        report["estimate"] = _estimate_as(reps[0], cfg, report)
        facts["estimate_s"] = time.perf_counter() - t1
    return report, facts


def _estimate_as(rank: int, cfg: Config, report: dict[str, Any]) -> dict[str, Any]:
    """The pre-flight estimate (parallel/estimate.py), as `rank` of the mesh on a fake process
    group: one fake training step of the policy (and, where it checkpoints, of the policy
    without activation checkpointing)."""
    from composerun.models.init import why_not_on_meta
    from composerun.parallel.apply import loss_parallel
    from composerun.parallel.estimate import FakeStep, estimate, estimate_policy, without_ac

    shape = cfg.mesh.shape
    compat.init_fake_process_group(rank, math.prod(shape))
    try:
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(mesh_dim_names(shape, cfg.mesh.dim_names)))

        def fake_step(sharding: Any) -> FakeStep:
            with torch.device("meta"):
                model = build_model(cfg.model, cfg.adapter, cfg.train.seed)
            fake = None
            if why_not_on_meta(model) is not None:  # (tied weights, tensors outside the registry)
                fake = compat.fake_tensor_mode()  # built whole, of fake tensors, where it holds them
                with fake:
                    model = build_model(cfg.model, cfg.adapter, cfg.train.seed)
            return FakeStep(cfg, model, loss_parallel(apply_policy(model, sharding, mesh)), fake)

        policy = estimate_policy(cfg.sharding)
        checkpoints = any(r.api.value == "checkpoint" for r in policy.rules)
        no_ac = fake_step(without_ac(policy)) if checkpoints else None
        return estimate(cfg, fake_step(policy), report, rank, no_ac)
    finally:
        dist.destroy_process_group()
