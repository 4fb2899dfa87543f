"""The applied plan as a table (printed on rank 0) and as plan.json.

One row per module a rule targeted: FQN, APIs, mesh dims, options, the local shard
shapes of the parameters the unit owns, and bytes per rank for parameters, gradients
and optimizer state.  Bytes are measured from each rank's local shards and gathered,
so plan.json holds every rank's figure.  Optimizer bytes assume the optimizer keeps
`OPT_STATES` full-size tensors per parameter (AdamW: exp_avg, exp_avg_sq; the 0-dim
step counters are not counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composerun.files import write_json
from composerun.sharding import ROOT, Unit, unit_params

OPT_STATES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1, "SGD": 0}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def optim_state_factor(optim_target: str, optim_kwargs: dict[str, Any] | None = None) -> int:
    name = optim_target.rsplit(".", 1)[-1]
    if name == "SGD":
        return 1 if (optim_kwargs or {}).get("momentum", 0) else 0
    return OPT_STATES.get(name, 2)


def local_rows(model: nn.Module, plan: dict[str, Unit], opt_factor: int) -> list[dict[str, Any]]:
    """This rank's view: one row per planned module, plus parameters no rule owns."""
    owned = unit_params(model, plan)
    rows = []
    fqns = list(plan) + ([""] if "" not in plan and "" in owned else [])
    for fqn in fqns:
        u = plan.get(fqn)
        params = owned.get(fqn, [])
        pbytes = sum(_local(p).numel() * p.element_size() for _, p in params)
        rows.append(
            {
                "fqn": fqn or ROOT,
                "apis": u.apis if u else [],
                "mesh_dims": (u.mesh_dims if u and u.mesh_dims else None),
                "options": u.options if u else {},
                "params": [
                    {"name": n, "shape": list(p.shape), "local_shape": list(_local(p).shape)} for n, p in params
                ],
                "param_bytes": pbytes,
                "grad_bytes": pbytes,
                "optim_bytes": opt_factor * pbytes,
            }
        )
    return rows


def build_report(model: nn.Module, plan: dict[str, Unit], opt_factor: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Gather every rank's rows; the result (same on all ranks) is what plan.json holds."""
    mine = local_rows(model, plan, opt_factor)
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(every, [(r["param_bytes"], [p["local_shape"] for p in r["params"]]) for r in mine])
    else:
        every = [[(r["param_bytes"], [p["local_shape"] for p in r["params"]]) for r in mine]]
    units = []
    for i, row in enumerate(mine):
        per_rank = [every[r][i][0] for r in range(world)]
        row = dict(row)
        for p_i, p in enumerate(row["params"]):
            p["local_shape_per_rank"] = [every[r][i][1][p_i] for r in range(world)]
            del p["local_shape"]
        row["bytes_per_rank"] = {
            "params": per_rank,
            "grads": per_rank,
            "optim": [opt_factor * b for b in per_rank],
        }
        for k in ("param_bytes", "grad_bytes", "optim_bytes"):
            del row[k]
        units.append(row)
    totals = {
        k: [sum(u["bytes_per_rank"][k][r] for u in units) for r in range(world)] for k in ("params", "grads", "optim")
    }
    return {**meta, "world_size": world, "units": units, "bytes_per_rank": totals}


def gather_measured_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Bytes this rank really holds (local shards of parameters, gradients and optimizer
    state tensors; 0-dim step counters excluded), gathered from every rank."""
    mine = {
        "params": sum(_local(p).nbytes for p in model.parameters()),
        "grads": sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None),
        "optim": sum(
            _local(v).nbytes for st in optim.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0
        ),
    }
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    return {k: [e[k] for e in every] for k in mine}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def format_table(report: dict[str, Any]) -> str:
    head = ["FQN", "API", "mesh dims", "options", "local shard (rank 0)", "params/rank", "grads/rank", "optim/rank"]
    rows = []
    for u in report["units"]:
        shards = ", ".join("x".join(map(str, p["local_shape_per_rank"][0])) or "()" for p in u["params"][:3])
        if len(u["params"]) > 3:
            shards += f", +{len(u['params']) - 3}"
        opts = ",".join(f"{k}={v}" for k, v in u["options"].items())
        b = u["bytes_per_rank"]
        rows.append(
            [
                u["fqn"],
                "+".join(u["apis"]) or "-",
                ",".join(u["mesh_dims"]) if u["mesh_dims"] else ("all" if u["apis"] else "-"),
                opts or "-",
                shards or "-",
                _fmt_bytes(max(b["params"])),
                _fmt_bytes(max(b["grads"])),
                _fmt_bytes(max(b["optim"])),
            ]
        )
    t = report["bytes_per_rank"]
    rows.append(
        [
            "total (max rank)",
            "",
            "",
            "",
            "",
            _fmt_bytes(max(t["params"])),
            _fmt_bytes(max(t["grads"])),
            _fmt_bytes(max(t["optim"])),
        ]
    )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    title = f"plan: {report.get('model')} on mesh {report.get('mesh')} ({report['world_size']} ranks), policy {report.get('policy')}"
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *map(line, rows)])


def write_plan(path: Path, report: dict[str, Any]) -> None:
    write_json(path, report)
