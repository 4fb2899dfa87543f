"""Tensor parallelism's communication per training step, for the plan: traced, not modelled.

Which collectives tensor parallelism issues depends on how the styles meet (a prepare_input
gathering what the norm left sharded, the gradients of q/k/v summing before one
reduce-scatter, loss_parallel's reductions, recomputation under activation checkpointing),
so the plan does not guess it from the styles: it builds the model on the meta device,
applies the policy's tensor parallelism and activation checkpointing over the `tp` mesh,
and runs one micro-batch forward and backward on meta tensors (fake ones for a transformers
model; shapes only either way: nothing is computed and nothing is sent), recording every functional collective DTensor issues
(_torch_compat.recording_functional_collectives).  A real run and `plan=true` (on the fake
process group) trace the same step, so their plan.json agree.

Bytes are the unsharded payload, as for FSDP in plan.py: an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor; times `train.grad_accum` micro-batches.
Approximations, stated in docs/planning.md: activations are traced in the dtype of the first
data-parallel unit's `param_dtype` (FSDP's mixed precision) or the model's own; a compiled module's collectives
are counted as eager code issues them; selective checkpointing that keeps a collective's
output is counted as if it recomputed it; mode budget's recomputation (the compiler's
choice) is not counted.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from composerun import _torch_compat as compat
from composerun.config.schema import Config, micro_batch_of
from composerun.errors import ConfigError
from composerun.models import build_model
from composerun.models.hf_tp import is_transformers
from composerun.parallel import compile as compiling
from composerun.parallel.rules import TP_DIM, assign_units, effective_rules

TP_COLLECTIVES = ("tp_all_gather", "tp_reduce_scatter", "tp_all_reduce")


def _meta_batch(cfg: Config, device: str = "meta") -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch's input on the meta device (or `device`): token ids, or features."""
    micro = micro_batch_of(cfg)
    if cfg.model.task.value == "tokens":
        seq = cfg.data.seq_len or cfg.model.seq_len
        ids = torch.zeros(micro, seq, dtype=torch.long, device=device)
        return ids, ids
    return torch.zeros(micro, cfg.model.in_dim or cfg.model.dim or 1, device=device), None


def trace_tp_comm(cfg: Config, tp_mesh: DeviceMesh | None) -> dict[str, int]:
    """Bytes of each tensor-parallel collective per optimizer step ({} without a parallelize
    rule: plan.json then has no tp_* keys)."""
    from composerun.parallel.apply import align_grads, loss_context, loss_parallel, misaligned_grads
    from composerun.parallel.styles import parallelize

    rules = effective_rules(cfg.sharding)
    if tp_mesh is None or not any(r.api.value == "parallelize" for r in rules):
        return {}
    counts = dict.fromkeys(TP_COLLECTIVES, 0)
    tp = tp_mesh.size()
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.adapter, cfg.train.seed)
    units = assign_units(model, rules, {TP_DIM: tp})
    dtype = next(
        (getattr(torch, u.options["param_dtype"]) for u in units.values() if u.options.get("param_dtype")), None
    )
    if dtype is not None:
        model.to(dtype)
    modules = dict(model.named_modules())
    for u in units.values():  # tensor parallelism first, then activation checkpointing (rules.py's order)
        if "parallelize" in u.apis:
            parallelize(modules[u.fqn], u.api_options["parallelize"]["styles"], tp_mesh)
    for u in units.values():
        ac = u.api_options.get("checkpoint")
        if ac is not None and ac["mode"] != "budget":
            compiling.checkpoint_forward(modules[u.fqn], ac)

    def record(kind: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        counts[f"tp_{kind}"] += n * (tp if kind == "all_gather" else 1)

    # transformers' forward asks a tensor's values (a packed-sequence check of the positions)
    # unless it is a fake tensor, which it knows holds none: its model is traced on fake tensors
    hf = is_transformers(model)
    fake = compat.fake_tensor_mode() if hf else nullcontext()
    with fake:
        if hf:
            model.to_empty(device="cpu")
        x, y = _meta_batch(cfg, "cpu" if hf else "meta")
    try:
        with fake, compat.recording_functional_collectives(record), loss_context(loss_parallel(units)):
            out = model(x)
            if y is not None:
                loss = F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
            else:
                loss = out.float().pow(2).mean()
            loss.backward()
    except RuntimeError as e:  # styles that do not fit the forward (a sequence split a module cannot take)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"sharding={cfg.sharding.name or 'the policy'}: the model's forward fails under its tensor-parallel "
            f"styles ({first}); check the styles' input and output layouts of the parallelized modules"
        ) from None
    micro = {k: v * cfg.train.grad_accum for k, v in counts.items()}  # every micro-batch's forward and backward
    counts.update(dict.fromkeys(counts, 0))
    with fake, compat.recording_functional_collectives(record):
        align_grads(misaligned_grads(model))
    # the gradients' re-placement over tp: once a step by the training loop, or, where FSDP holds
    # the parameters, by FSDP's post-backward after every micro-batch
    times = cfg.train.grad_accum if any("fully_shard" in u.apis for u in units.values()) else 1
    return {k: micro[k] + times * counts[k] for k in counts}


def tp_shape(p: Any) -> list[int]:
    """A parameter's shape as tensor parallelism leaves it on a rank (before FSDP shards it
    further): its global shape with each dim split over `tp` divided (ceil, torch.chunk's)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(p.shape)
    if not isinstance(p, DTensor):
        return shape
    names = p.device_mesh.mesh_dim_names or ()
    for name, size, placement in zip(names, p.device_mesh.shape, p.placements, strict=True):
        if name == TP_DIM and isinstance(placement, Shard):
            shape[placement.dim] = -(-shape[placement.dim] // size)
    return shape
