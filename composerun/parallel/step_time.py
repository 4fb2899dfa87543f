"""The estimate's step time on a named device (parallel/estimate.py): torch's roofline of each
op of the traced step (RuntimeEstimator's model: an op takes max(its FLOPs / 75 % of the
device's peak, its bytes read and written / the memory bandwidth)), the optimizer step as
bandwidth (7 fp32 reads and writes per parameter), and the collectives priced by the mesh
dims they span (parallel/topology.py: NVLink inside a node, the NICs across nodes); without
overlap of compute and communication (the estimate) and with full overlap (a lower bound);
tokens/s and MFU from the first."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composerun import _torch_compat as compat
from composerun.config.schema import Config, dp_size_of
from composerun.devices import Device
from composerun.models.flops import flops_per_token
from composerun.parallel.topology import comm_assumptions, comm_time


class Roofline(compat.TorchDispatchMode):
    """torch's roofline of each op on `device` (RuntimeEstimator's model, which needs a GPU
    there is not: its FLOP formulas, this device's datasheet): seconds and FLOPs summed."""

    IGNORED = ("view", "_unsafe_view", "t", "transpose", "expand", "permute", "detach", "alias", "slice",
               "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "as_strided",
               "zeros_like", "ones_like", "empty_like", "empty", "zeros", "ones", "arange", "full",
               "lift_fresh", "_to_copy", "clone", "new_empty", "new_zeros", "empty_strided")  # fmt: skip

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device, self.seconds, self.flops = device, 0.0, 0.0
        self.formulas = compat.flop_formulas()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs first and comes back with its local ops
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet.__name__ in self.IGNORED or func.namespace != "aten":
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        flops = 0.0
        if packet in self.formulas:
            flops = float(self.formulas[packet](*args, **kwargs, out_val=out))
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        peak = self.device.fp32_flops if floats and all(d == torch.float32 for d in floats) else self.device.bf16_flops
        self.flops += flops
        self.seconds += max(flops / (0.75 * peak), moved / (self.device.memory_gbs * 1e9))
        return out


def step_time(
    cfg: Config, device: Device, roof: Roofline, report: dict[str, Any], model: nn.Module, micro: int
) -> dict[str, Any]:
    """The step time on `device` from the traced step (the module's docstring)."""
    comm = comm_time(report, cfg, device)
    comm_s = comm["comm_s"]
    params = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
    )
    optimizer_s = 7 * 4 * params / (device.memory_gbs * 1e9)
    compute_s = roof.seconds + optimizer_s
    step_s = compute_s + comm_s
    out: dict[str, Any] = {
        "device": device.name,
        "compute_s": compute_s,
        "optimizer_s": optimizer_s,
        "comm_s": comm_s,
        "step_s": step_s,
        "step_s_overlapped": max(compute_s, comm_s),
        "comm_per_kind_s": comm["per_kind_s"],
        "comm_per_unit_s": comm["units"],
        "topology": report["topology"],
        "assumptions": [
            "roofline per op: max(FLOPs / (0.75 x the datasheet peak), bytes moved / the memory bandwidth)",
            *comm_assumptions(report["topology"]),
            "step_s: compute and communication not overlapped; step_s_overlapped: fully overlapped",
            "eager kernels (compile's fusion not modelled); no allocator or launch overheads",
        ],
    }
    if cfg.model.task.value == "tokens":
        seq = cfg.data.seq_len or cfg.model.seq_len
        world = math.prod(cfg.mesh.shape)
        dp = dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
        tps = micro * dp * cfg.train.grad_accum * seq / step_s  # the traced step's tokens
        out["tokens_per_s"] = tps
        out["mfu"] = flops_per_token(model, seq) * tps / world / device.bf16_flops
    return out
