"""`checkpoint.verify=true`: what torch's VerifyStateDictMixin checks, as a feature.

At the end of a run, the distributed model and optimizer are compared with a reference:
the same model trained on rank 0 alone, with no distributed API, from the same
initialization through the same global batches, LR schedule and clipping.

- model: the gathered full state dict equals the reference's, key for key (allclose);
- optimizer: the FQN-keyed optimizer state dict has the same states per parameter and
  the same param groups as the reference's, values allclose;
- round trip: a fresh optimizer loaded from the distributed optimizer state dict gives
  back the same state dict.

The reference costs one extra training run on rank 0, so this is meant for the small
models of tests and layout comparisons.  The report lands in summary.json under `verify`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from composerun.checkpoint.export import full_state_dict_on_rank0, read_full_state_dict
from composerun.checkpoint.state import optim_state_for_load
from composerun.config.schema import Config, OptimConfig
from composerun.data.sources import forward
from composerun.models import build_model
from composerun.models.init import build, materialize
from composerun.train.optim import build_optimizer, set_lr

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class VerifyError(RuntimeError):
    """The distributed run does not match its 1-rank reference."""


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel()]
    return max(diffs, default=0.0)


def _train_reference(
    cfg: Config, data: Any, steps: int, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # the distributed run's initial weights: made on its device (its random generator), then here
    offload = any(r.offload for r in cfg.sharding.rules)
    model, on_meta = build(cfg.model, cfg.train.seed, device, offload, cfg.adapter)
    if on_meta:
        materialize(model, device, cfg.train.seed, lambda: build_model(cfg.model, cfg.adapter, cfg.train.seed))
    model.to("cpu")
    if cfg.checkpoint.init_from:
        model.load_state_dict(read_full_state_dict(Path(cfg.checkpoint.init_from)))
    ocfg = cfg.optim
    optim = build_optimizer(model, ocfg)
    gb = cfg.data.batch_size
    for step in range(steps):
        set_lr(optim, step, steps, ocfg)
        x, y = data.batch(range(step * gb, (step + 1) * gb))
        data.loss(forward(model, x), y).backward()
        clip = ocfg.grad_clip
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        optim.step()
        optim.zero_grad(set_to_none=True)
    return model, optim


def _fqn_optim_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {k: torch.as_tensor(v).detach().cpu() for k, v in st.items()} for p, st in optim.state.items()
    }


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _round_trip_ok(model: torch.nn.Module, optim: torch.optim.Optimizer, ocfg: OptimConfig) -> bool:
    """Every rank: a fresh optimizer loaded from this one's state dict gives it back."""
    osd = get_optimizer_state_dict(model, optim)
    fresh = build_optimizer(model, ocfg)
    set_optimizer_state_dict(model, fresh, optim_state_for_load(model, osd))
    again = get_optimizer_state_dict(model, fresh)
    ok = osd["state"].keys() == again["state"].keys() and _groups(osd["param_groups"]) == _groups(again["param_groups"])
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            ok = ok and torch.equal(torch.as_tensor(_local(v)), torch.as_tensor(_local(again["state"][fqn][k])))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def verify(
    cfg: Config, model: torch.nn.Module, optim: torch.optim.Optimizer, data: Any, steps: int | None = None
) -> dict[str, Any]:
    """Run on every rank after training `steps` (default: train.steps); returns the report (the
    same on every rank)."""
    steps = cfg.train.steps if steps is None else steps
    mixed = any(r.param_dtype for r in cfg.sharding.rules) or cfg.sharding.param_dtype
    atol = 5e-2 if mixed else 1e-5
    round_trip = _round_trip_ok(model, optim, cfg.optim)
    got_model = full_state_dict_on_rank0(model)
    got_optim = get_optimizer_state_dict(model, optim, options=FULL)
    report: list[Any] = [None]
    if dist.get_rank() == 0:
        first = next(iter(model.parameters()), None)
        device = torch.as_tensor(_local(first)).device if first is not None else torch.device("cpu")
        ref_model, ref_optim = _train_reference(cfg, data, steps, device)
        want_model = ref_model.state_dict()
        want_state = _fqn_optim_state(ref_model, ref_optim)
        got_state = {n: {k: torch.as_tensor(v) for k, v in st.items()} for n, st in got_optim["state"].items()}
        model_keys = set(got_model) == set(want_model)
        optim_keys = got_state.keys() == want_state.keys() and all(
            got_state[n].keys() == want_state[n].keys() for n in want_state
        )
        m_diff = _max_diff(got_model, want_model) if model_keys else math.inf
        o_diff = (
            max((_max_diff(got_state[n], want_state[n]) for n in want_state), default=0.0) if optim_keys else math.inf
        )
        groups = _groups(got_optim["param_groups"]) == _groups(ref_optim.state_dict()["param_groups"])
        report = [
            {
                "atol": atol,
                "model": {"keys_equal": model_keys, "max_abs_diff": m_diff, "ok": model_keys and m_diff <= atol},
                "optim": {
                    "keys_equal": optim_keys,
                    "param_groups_equal": groups,
                    "max_abs_diff": o_diff,
                    "ok": optim_keys and groups and o_diff <= atol,
                },
                "optim_round_trip": {"ok": round_trip},
            }
        ]
        r = report[0]
        r["ok"] = r["model"]["ok"] and r["optim"]["ok"] and round_trip
    dist.broadcast_object_list(report, src=0)
    return report[0]


def failure_line(report: dict[str, Any]) -> str:
    parts = []
    for what in ("model", "optim"):
        r = report[what]
        if not r["ok"]:
            parts.append(
                f"{what} differs from the 1-rank reference (keys equal: {r['keys_equal']}, "
                f"max |diff| {r['max_abs_diff']:.3g} > {report['atol']})"
            )
    if not report["optim_round_trip"]["ok"]:
        parts.append("a fresh optimizer loaded from the optimizer state dict does not give it back")
    return "verification failed: " + "; ".join(parts)
