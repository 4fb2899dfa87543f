"""The applied plan as a table (printed on rank 0) and as plan.json.

One row per module a rule targeted: FQN, APIs, mesh dims, options, the local shard
shapes of the parameters the unit owns, and bytes per rank for parameters, gradients
and optimizer state.  Bytes are measured from each rank's local shards and gathered,
so plan.json holds every rank's figure.  Optimizer bytes assume the optimizer keeps
`OPT_STATES` full-size tensors per parameter (AdamW: exp_avg, exp_avg_sq; the 0-dim
step counters are not counted).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composerun.config.schema import Config, dp_size_of, mesh_dim_names
from composerun.parallel.rules import ROOT, Unit, data_parallel_dims, unit_params
from composerun.parallel.topology import mesh_topology, topology_line
from composerun.parallel.tp_comm import tp_shape
from composerun.rundir import write_json

OPT_STATES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1, "SGD": 0}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def optim_state_factor(optim_target: str, optim_kwargs: dict[str, Any] | None = None) -> int:
    name = optim_target.rsplit(".", 1)[-1]
    if name == "SGD":
        return 1 if (optim_kwargs or {}).get("momentum", 0) else 0
    return OPT_STATES.get(name, 2)


def local_rows(model: nn.Module, units: dict[str, Unit], opt_factor: int) -> list[dict[str, Any]]:
    """This rank's view: one row per planned module, in the model's order (the root last), plus
    parameters no rule owns."""
    owned = unit_params(model, units)
    rows = []
    position = {name: i for i, (name, _) in enumerate(model.named_modules()) if name}  # "" (the root): last
    fqns = sorted(units, key=lambda f: position.get(f, len(position)))
    fqns += [""] if "" not in units and "" in owned else []
    for fqn in fqns:
        u = units.get(fqn)
        params = owned.get(fqn, [])
        pbytes = sum(_local(p).numel() * p.element_size() for _, p in params)
        # gradients and optimizer state: of the parameters that train (adapter=lora freezes the base)
        tbytes = sum(_local(p).numel() * p.element_size() for _, p in params if p.requires_grad)
        row = {
            "fqn": fqn or ROOT,
            "apis": u.apis if u else [],
            "mesh_dims": (u.mesh_dims if u and u.mesh_dims else None),
            "options": u.options if u else {},
        }
        if u and u.api_options:  # compile, checkpoint's mode, float8's linears, the TP styles
            row["api_options"] = u.api_options
        rows.append(
            {
                **row,
                "params": [
                    {
                        "name": n,
                        "shape": list(p.shape),
                        "dtype": str(p.dtype).removeprefix("torch."),
                        **({"tp_shape": tp_shape(p)} if tp_shape(p) != list(p.shape) else {}),
                        "local_shape": list(_local(p).shape),
                        **({} if p.requires_grad else {"frozen": True}),
                    }
                    for n, p in params
                ],
                "param_bytes": pbytes,
                "grad_bytes": tbytes,
                "optim_bytes": opt_factor * tbytes,
            }
        )
    return rows


def report_meta(cfg: Config) -> dict[str, Any]:
    """What plan.json says about the run besides the units."""
    shape = cfg.mesh.shape
    return {
        "model": cfg.model.name or cfg.model._target_,
        "mesh": "x".join(map(str, shape)),
        "mesh_dims": mesh_dim_names(shape, cfg.mesh.dim_names),
        "policy": cfg.sharding.name,
    }


def _rank_view(rows: list[dict[str, Any]]) -> list[tuple[int, list[list[int]], int]]:
    return [(r["param_bytes"], [p["local_shape"] for p in r["params"]], r["grad_bytes"]) for r in rows]


def build_report(model: nn.Module, units: dict[str, Unit], cfg: Config, tp_comm: dict[str, int]) -> dict[str, Any]:
    """Gather every rank's rows; the result (same on all ranks) is what plan.json holds.
    `tp_comm`: tensor parallelism's collectives per step (tp_comm.trace_tp_comm)."""
    opt_factor = optim_state_factor(cfg.optim._target_, cfg.optim.kwargs)
    mine = local_rows(model, units, opt_factor)
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list[Any] = [_rank_view(mine)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, _rank_view(mine))
    return assemble_report(mine, every, cfg, tp_comm)


def assemble_report(mine: list[dict[str, Any]], every: list[Any], cfg: Config, tp_comm: dict[str, int]) -> dict[str, Any]:
    """plan.json from one rank's rows and every rank's (bytes, local shapes, trained bytes) per unit: the
    same function for a real run (gathered over the ranks) and the planner (fake ranks)."""
    opt_factor = optim_state_factor(cfg.optim._target_, cfg.optim.kwargs)
    world = len(every)
    units = []
    for i, row in enumerate(mine):
        per_rank, trained = [every[r][i][0] for r in range(world)], [every[r][i][2] for r in range(world)]
        row = {k: v for k, v in row.items() if k not in ("param_bytes", "grad_bytes", "optim_bytes")}
        row["params"] = [
            {
                **{k: v for k, v in p.items() if k != "local_shape"},
                "local_shape_per_rank": [every[r][i][1][p_i] for r in range(world)],
            }
            for p_i, p in enumerate(row["params"])
        ]
        grads = [_unsharded_grad_bytes(row)] * world if _accumulates_unsharded(row, cfg) else trained
        row["bytes_per_rank"] = {"params": per_rank, "grads": grads, "optim": [opt_factor * b for b in trained]}
        row["comm_per_step"] = unit_comm(row, cfg)
        row["comm_spans"] = unit_spans(row, cfg)
        units.append(row)
    totals = {
        k: [sum(u["bytes_per_rank"][k][r] for u in units) for r in range(world)] for k in ("params", "grads", "optim")
    }
    held = [sum(totals[k][r] for k in totals) for r in range(world)]
    frozen = [sum(every[r][i][0] - every[r][i][2] for i in range(len(mine))) for r in range(world)]
    # adapter=lora: the frozen base's bytes per rank, and the gradients and optimizer state it does not have
    lora = {"frozen": {"bytes_per_rank": frozen, "saved_per_rank": [(1 + opt_factor) * b for b in frozen]}}
    return {
        **(lora if any(frozen) else {}),
        **report_meta(cfg),
        "world_size": world,
        "units": units,
        "bytes_per_rank": totals,
        # params + grads + optimizer state; the first such rank when several hold the same
        "largest_rank": {"rank": held.index(max(held)), "bytes": max(held)},
        "smallest_rank": {"rank": held.index(min(held)), "bytes": min(held)},
        # data-parallel collectives summed over the units; tensor parallelism's traced for the step
        "comm_per_step": {**{k: sum(u["comm_per_step"][k] for u in units) for k in COLLECTIVES}, **tp_comm},
        # the mesh laid on nodes: which dims' groups cross nodes, and the links they are priced at
        "topology": mesh_topology(cfg),
    }


def _accumulates_unsharded(row: dict[str, Any], cfg: Config) -> bool:
    """Whether this unit keeps whole gradients between micro-batches (sharding.accumulate_unsharded)."""
    return cfg.sharding.accumulate_unsharded and cfg.train.grad_accum > 1 and "fully_shard" in row["apis"]


def _unsharded_grad_bytes(row: dict[str, Any]) -> int:
    """The unit's whole gradients, as FSDP accumulates them (in reduce_dtype)."""
    o = row["options"]
    rdt = o.get("reduce_dtype") or o.get("param_dtype")
    trained = [p for p in row["params"] if not p.get("frozen")]
    return sum(math.prod(p["shape"]) * getattr(torch, rdt or p["dtype"]).itemsize for p in trained)


# --- communication volume ----------------------------------------------------------------

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _group_sizes(dims: list[str] | None, cfg: Config) -> tuple[int, int]:
    """(shard group size, replicate group size) of a fully_shard unit on this mesh."""
    shape = cfg.mesh.shape
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    size = dict(zip(names, shape, strict=True))
    if dims is None:  # every data-parallel dim as one (not `tp`)
        return math.prod(size[d] for d in data_parallel_dims(names)), 1
    if len(dims) == 1:
        return size[dims[0]], 1
    return size[dims[-1]], size[dims[0]]  # HSDP: shards over the last named dim, replicates over the first


def unit_comm(row: dict[str, Any], cfg: Config) -> dict[str, int]:
    """Bytes each collective of this unit carries per optimizer step (the unsharded payload:
    with ring algorithms each rank sends (n-1)/n of an all-gather or reduce-scatter payload
    and 2(n-1)/n of an all-reduce).  FSDP all-gathers the unit's parameters (in param_dtype)
    before forward, again before backward when it resharded after forward (never for the
    root, which FSDP keeps unsharded), and reduce-scatters the gradients (in reduce_dtype)
    after every micro-batch (with sharding.accumulate_unsharded, once, on the last); HSDP then
    all-reduces the accumulated shards over the replicate dim, once.
    replicate all-reduces the gradients."""
    out = dict.fromkeys(COLLECTIVES, 0)
    if not any(a in ("fully_shard", "replicate") for a in row["apis"]):
        return out
    o = row["options"]

    def nbytes(p: dict[str, Any], dtype: str | None, dim0: int | None = None) -> int:
        rest = math.prod(p["shape"][1:])
        n = (p["shape"][0] if dim0 is None else dim0) * rest if p["shape"] else 1
        return n * getattr(torch, dtype or p["dtype"]).itemsize

    # FSDP shards (and gathers) what tensor parallelism left on the rank
    params = [{**p, "shape": p.get("tp_shape", p["shape"])} for p in row["params"]]
    grads = [p for p in params if not p.get("frozen")]  # (a frozen parameter has no gradient to reduce)
    pdt, rdt = o.get("param_dtype"), o.get("reduce_dtype") or o.get("param_dtype")
    if "replicate" in row["apis"]:
        replicas = dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
        out["all_reduce"] = sum(nbytes(p, rdt) for p in grads) if replicas > 1 else 0
        return out
    shard, repl = _group_sizes(row["mesh_dims"], cfg)
    # FSDP pads dim 0 of every parameter to a multiple of the shard group and sends the padding too
    padded = lambda p: -(-(p["shape"] or [1])[0] // shard) * shard  # noqa: E731
    # float8 all-gather (a float8 rule on the unit's own module): its converted weights travel as float8
    f8 = row.get("api_options", {}).get("float8", {})
    base = "" if row["fqn"] == ROOT else row["fqn"] + "."
    in_f8 = {f"{base}{sub}.weight" for sub in f8.get("converted", [])} if f8.get("all_gather") else set()
    pbytes = sum(nbytes(p, "float8_e4m3fn" if p["name"] in in_f8 else pdt, padded(p)) for p in params)
    gbytes = sum(nbytes(p, rdt, padded(p)) for p in grads)
    gathers, scatters = _fsdp_calls(row, cfg)
    if shard > 1:
        out["all_gather"] = gathers * pbytes
        out["reduce_scatter"] = scatters * gbytes
    if repl > 1:  # the padded shards FSDP reduce-scattered (dim 0 padded to a multiple of the group)
        out["all_reduce"] = sum(nbytes(p, rdt, -(-(p["shape"] or [1])[0] // shard)) for p in grads)
    return out


def _fsdp_calls(row: dict[str, Any], cfg: Config) -> tuple[int, int]:
    """How many all-gathers and reduce-scatters a fully_shard unit issues per optimizer step."""
    accum = cfg.train.grad_accum
    # with reshard_after_backward=false, parameters stay unsharded between micro-batches
    fwd = 1 if not cfg.sharding.reshard_after_backward else accum
    bwd = accum if row["options"].get("reshard_after_forward", True) and row["fqn"] != ROOT else 0
    # every micro-batch's gradients, unless whole ones are kept until the last
    return fwd + bwd, (1 if cfg.sharding.accumulate_unsharded else accum)


def unit_spans(row: dict[str, Any], cfg: Config) -> dict[str, dict[str, Any]]:
    """The mesh dims each of this unit's collectives runs over and how many it issues per
    optimizer step (the collectives unit_comm counts bytes of; parallel/topology.py prices
    them): FSDP all-gathers and reduce-scatters over its shard dims (every data-parallel dim
    as one where the rule names none; HSDP: the last named dim) and HSDP all-reduces over
    the first; replicate all-reduces over the data-parallel dims."""
    comm = row["comm_per_step"]
    names = mesh_dim_names(cfg.mesh.shape, cfg.mesh.dim_names)
    dims = row["mesh_dims"] or data_parallel_dims(names)
    if "replicate" in row["apis"]:
        spans = {"all_reduce": (data_parallel_dims(names), 1)}
    else:
        gathers, scatters = _fsdp_calls(row, cfg)
        spans = {"all_gather": (dims[-1:] if row["mesh_dims"] else dims, gathers), "all_reduce": (dims[:1], 1)}
        spans["reduce_scatter"] = (spans["all_gather"][0], scatters)
    return {k: {"dims": list(spans[k][0]), "calls": spans[k][1]} for k in COLLECTIVES if comm.get(k)}


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


def fmt_bytes(n: float) -> str:
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
                "+".join(_api_cell(a, u.get("api_options", {}).get(a, {})) for a in u["apis"]) or "-",
                _dims_cell(u, report.get("mesh_dims") or []),
                opts or "-",
                shards or "-",
                fmt_bytes(max(b["params"])),
                fmt_bytes(max(b["grads"])),
                fmt_bytes(max(b["optim"])),
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
            fmt_bytes(max(t["params"])),
            fmt_bytes(max(t["grads"])),
            fmt_bytes(max(t["optim"])),
        ]
    )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    world = report["world_size"]
    title = f"plan: {report.get('model')} on mesh {report.get('mesh')} ({world} rank{'s' * (world != 1)}), policy {report.get('policy')}"
    big, small, comm = report["largest_rank"], report["smallest_rank"], report["comm_per_step"]
    tail = [
        f"largest shards: rank {big['rank']} ({fmt_bytes(big['bytes'])}); "
        f"smallest: rank {small['rank']} ({fmt_bytes(small['bytes'])}) -- params + grads + optimizer state",
        "per step: " + ", ".join(f"{k.replace('_', '-')} {fmt_bytes(v)}" for k, v in comm.items()),
        *([topology_line(report["topology"])] if report.get("topology") and report["world_size"] > 1 else []),
        *([f"frozen: {fmt_bytes(max(f['bytes_per_rank']))} of the params/rank (the adapters' base) hold no grads or "
           f"optimizer state: {fmt_bytes(max(f['saved_per_rank']))} saved"] if (f := report.get("frozen")) else []),
    ]
    skipped = {
        f"{u['fqn']}.{sub}" if u["fqn"] != ROOT else sub: why
        for u in report["units"]
        for sub, why in u.get("api_options", {}).get("float8", {}).get("skipped", {}).items()
    }
    if skipped:
        listed = "; ".join(f"{k} ({v})" for k, v in list(skipped.items())[:4])
        tail.append(f"float8 skips {len(skipped)} linears: {listed}{'; ...' if len(skipped) > 4 else ''} (plan.json)")
    whole: dict[str, list[str]] = {}  # the model's own tp plan leaves these whole (tied embeddings)
    for u in report["units"]:
        for sub, why in u.get("api_options", {}).get("parallelize", {}).get("unsplit", {}).items():
            whole.setdefault(why, []).append(f"{u['fqn']}.{sub}" if u["fqn"] != ROOT else sub)
    tail += [f"tensor parallelism leaves {', '.join(names)} whole: {why}" for why, names in whole.items()]
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *map(line, rows), *tail])


def _api_cell(api: str, o: dict[str, Any]) -> str:
    """An API and what sets it apart, for the plan table (plan.json's api_options has all)."""
    if api == "checkpoint" and o.get("mode", "full") != "full":
        return f"checkpoint({o['mode']}" + (f" {o['memory_budget']}" if o["mode"] == "budget" else "") + ")"
    if api == "compile" and o.get("mode", "default") != "default":
        return f"compile({o['mode']})"
    if api == "float8":
        return f"float8({len(o.get('converted', []))} linears)"
    if api == "parallelize":
        return f"parallelize({len(o.get('styles', {}))} styles{', loss parallel' if o.get('loss_parallel') else ''})"
    return api


def _dims_cell(u: dict[str, Any], names: list[str]) -> str:
    """The mesh dims a module's APIs run over: the data-parallel API's, then `tp`."""
    dims = []
    if any(a in ("fully_shard", "replicate") for a in u["apis"]):
        if u["mesh_dims"]:
            dims.append(",".join(u["mesh_dims"]))
        else:
            dp = data_parallel_dims(names)
            dims.append("all" if dp == names else "+".join(dp))
    if "parallelize" in u["apis"]:
        dims.append("tp")
    return " | ".join(dims) or "-"


def write_plan(path: Path, report: dict[str, Any]) -> None:
    write_json(path, report)
