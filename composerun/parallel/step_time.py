"""The estimate's step time on a named device (parallel/estimate.py), with a range.

- Compute: every op of the traced step priced by its class (parallel/op_costs.py: matrix
  products, attention, memory-bound ops, compile's fusion, float8's products and casts), the
  optimizer step and gradient clipping as bytes per parameter, and no faster than eager
  PyTorch's host can issue the ops.
- Collectives: plan.json's bytes per unit, each over the links its mesh dims use
  (parallel/topology.py: NVLink inside a node, the NICs across nodes).  Exposed (not hidden behind compute): the all-gathers of the first
  two units of the forward (nothing to overlap them with), the reduce-scatters and
  all-reduces of the last two of the backward (the optimizer waits for them), and whatever
  the rest takes beyond the compute it overlaps with.
- The range: the fast end at the device's highest peak with only that exposure; the slow end
  at its lowest peak (a power-limited part's datasheet gives a span) with no collective
  overlapped at all.  tokens/s and MFU from the estimate between them.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

from composerun.config.schema import Config, dp_size_of
from composerun.devices import Device
from composerun.models.flops import flops_per_token
from composerun.parallel.op_costs import OpCosts
from composerun.parallel.topology import comm_assumptions, comm_time

# AdamW per parameter and step, fp32 (bytes read and written): fused, one kernel reads
# parameter, gradient and both moments and writes back three; torch's foreach loop makes
# about ten passes (lerp, mul, addcmul, mul for weight decay, sqrt, div, add, addcdiv)
OPTIMIZER_BYTES = {"fused": 28, "foreach": 80}
CLIP_BYTES = 12  # gradient clipping: the norm reads each gradient, the scaling reads and writes it


def _exposed(report: dict[str, Any], comm: dict[str, Any]) -> float:
    """The collectives nothing overlaps: one all-gather of each of the first two units of the
    forward (the root, then the first block), one reduce-scatter and all-reduce of the same
    two, the last of the backward (parallel/topology.py's seconds of a unit's kind, over its
    calls), and tensor parallelism's (on the critical path of every block)."""
    units = report["units"]
    order = sorted(range(len(units)), key=lambda i: units[i]["fqn"] != "<root>")[:2]
    out = 0.0
    for i in order:
        spans = units[i].get("comm_spans", {})
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            calls = (spans.get(kind) or {}).get("calls") or 0
            if calls:
                out += comm["units"][i][f"{kind}_s"] / calls
    return out + sum(v for k, v in comm["per_kind_s"].items() if k.startswith("tp_"))


def step_time(cfg: Config, device: Device, costs: OpCosts, report: dict[str, Any], model: nn.Module, micro: int) -> dict[str, Any]:
    """The step time on `device` from the traced step (the module's docstring)."""
    c = costs.totals()
    params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    fused = bool((cfg.optim.kwargs or {}).get("fused"))
    per_param = OPTIMIZER_BYTES["fused" if fused else "foreach"] + (CLIP_BYTES if cfg.optim.grad_clip else 0)
    optimizer_s = per_param * params / (costs.cal.bandwidth * device.memory_gbs * 1e9)
    gpu_s = c.matmul_s + c.attention_s + c.memory_s + optimizer_s
    host_s = c.kernels * costs.cal.host_op_s
    compute_s = max(gpu_s, host_s)
    comm = comm_time(report, cfg, device)
    comm_s = comm["comm_s"]
    exposed = min(comm_s, _exposed(report, comm))
    hidden = comm_s - exposed
    step_s = compute_s + exposed + max(0.0, hidden - compute_s)
    lo, hi = getattr(device, "bf16_flops_range", None) or (device.bf16_flops, device.bf16_flops)
    # the peak's share of the compute: products and attention scale with it, memory does not
    flop_bound = c.matmul_s + c.attention_s
    fast = compute_s - flop_bound * (1 - device.bf16_flops / hi) + exposed + max(0.0, hidden - compute_s)
    slow = compute_s + flop_bound * (device.bf16_flops / lo - 1) + comm_s
    out: dict[str, Any] = {
        "device": device.name,
        "calibration": costs.cal.name if costs.calibrated else f"none for {device.name} (Hopper's shares used)",
        "compute_s": compute_s,
        "matmul_s": c.matmul_s,
        "attention_s": c.attention_s,
        "memory_bound_s": c.memory_s,
        "optimizer_s": optimizer_s,
        "host_s": host_s,
        "kernels": c.kernels,
        "comm_s": comm_s,
        "exposed_comm_s": step_s - compute_s,
        "step_s": step_s,
        "step_s_range": [fast, slow],
        "step_s_overlapped": max(compute_s, comm_s),
        "comm_per_kind_s": comm["per_kind_s"],
        "comm_per_unit_s": comm["units"],
        "topology": report["topology"],
        "assumptions": [
            f"calibration {costs.cal.name}: products at {costs.cal.matmul:.0%} of the peak (wave quantization "
            f"off that), attention at FlashAttention-2's published H100 curve, memory-bound ops at "
            f"{costs.cal.bandwidth:.0%} of the bandwidth, compiled element-wise bytes x{costs.cal.fused_bytes}"
            + ("" if costs.calibrated else f" -- not calibrated for {device.name}"),
            f"optimizer {'fused' if fused else 'foreach'} AdamW: {per_param} bytes per parameter",
            f"collectives: {comm_s:.3g} s, of which {exposed:.3g} s exposed (the first all-gathers, the last "
            "reduce-scatters, tensor parallelism's) and the rest hidden behind compute where it fits",
            *comm_assumptions(report["topology"]),
            "range: fast end at the highest peak with only that exposure, slow end at the lowest peak with no "
            "collective overlapped",
            "not modelled: the compute slowed by collectives running beside it (their SMs and bandwidth), "
            "stragglers, data loading",
        ],
    }
    if c.fp8_saved_s:
        out["float8_saved_s"] = c.fp8_saved_s
    if cfg.model.task.value == "tokens":
        seq = cfg.data.seq_len or cfg.model.seq_len
        world = math.prod(cfg.mesh.shape)
        dp = dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
        tokens = micro * dp * cfg.train.grad_accum * seq  # the traced step's tokens
        out["tokens_per_s"] = tokens / step_s
        out["tokens_per_s_range"] = [tokens / slow, tokens / fast]
        out["tokens_per_s_per_gpu"] = tokens / step_s / world
        out["mfu"] = flops_per_token(model, seq) * out["tokens_per_s"] / world / device.bf16_flops
    return out
