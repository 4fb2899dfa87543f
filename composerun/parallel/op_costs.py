"""What each op of the estimate's fake training step costs on a GPU, by op class.

The fake step (parallel/estimate.py) runs every op of one training step on shapes alone.
`OpCosts`, a dispatch mode around it, sorts each op into a class and adds up what the GPU
would spend on it, from the device's datasheet (composerun/devices.py) and one calibration
per device class (`CALIBRATIONS`):

- matrix products (mm, addmm, bmm, _scaled_mm): their FLOPs at `matmul` x the peak of their
  dtype (bf16/fp16, fp8 for float8's products, fp32 without tensor cores), less the
  tensor-core wave quantization of their output tile grid (128 x 128 tiles over the SMs);
- attention (SDPA's kernels, forward and backward): the FLOPs it really does (a causal
  mask halves them; a boolean mask, packed documents' for the memory-efficient kernel, does
  not) at FlashAttention-2's published throughput for that sequence length in
  bf16 (`attention_fwd`, `attention_bwd`), at `fp32_attention` x the fp32 peak in fp32;
- everything else is memory-bound: the bytes it reads and writes at `bandwidth` x the
  memory bandwidth, with a floor of `launch_s` per kernel; in a compiled module, its
  element-wise ops fused (`fused_bytes` of their bytes moved, as a share of the forward's);
- the optimizer step and gradient clipping (not traced: after the step): bytes per
  parameter, fused AdamW or the foreach loop;
- float8 (a float8 rule's linears; the fake step runs them in bf16): their products at the
  fp8 peak, plus the casts (each operand's amax read, then read and written as float8).

A calibration holds only what a datasheet does not say; which measurement set each figure,
and which were only checked against it, is in BENCHMARKS.md (scripts/bench_estimate_published.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from composerun import _torch_compat as compat
from composerun.devices import Device

MATMULS = ("mm", "addmm", "bmm", "_scaled_mm", "baddbmm")
# ops that move no data (views, allocations without a fill)
FREE = ("view", "_unsafe_view", "t", "transpose", "expand", "permute", "detach", "alias", "slice",
        "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "as_strided",
        "empty_like", "empty", "new_empty", "empty_strided", "lift_fresh", "_reshape_alias")  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """What a device class achieves of its datasheet (module docstring)."""

    name: str
    matmul: float  # a large bf16 product's share of the dense peak
    # FlashAttention-2 forward and backward TFLOP/s by sequence length, as shares of the peak
    attention_fwd: tuple[tuple[int, float], ...]
    attention_bwd: tuple[tuple[int, float], ...]
    fp32_attention: float  # fp32 attention (the memory-efficient kernel) as a share of the fp32 peak
    bandwidth: float  # a memory-bound kernel's share of the memory bandwidth
    launch_s: float  # the least a kernel takes
    fused_bytes: float  # a compiled module's element-wise bytes, as a share of eager's
    host_op_s: float  # eager PyTorch's host time per op (the GPU cannot be faster than the host)
    calibrated_on: str = ""


# FlashAttention-3 paper (Shah et al., 2024), figures 5 and 6: FlashAttention-2 on an H100 SXM5
# (989 TFLOP/s dense bf16), head dim 128; forward with a causal mask, backward without.
_FA2_FWD = ((512, 191), (1024, 260), (2048, 298), (4096, 319), (8192, 333), (16384, 335))
_FA2_BWD = ((512, 214), (1024, 260), (2048, 291), (4096, 310), (8192, 318), (16384, 322))

HOPPER = Calibration(
    name="hopper",
    # a bf16 8192^3 product measured on the H100 SXM of BENCHMARKS.md's run: 788 and 751 TFLOP/s
    matmul=0.78,
    attention_fwd=tuple((s, t / 989.4) for s, t in _FA2_FWD),
    attention_bwd=tuple((s, t / 989.4) for s, t in _FA2_BWD),
    fp32_attention=0.5,
    # fitted: the project's own H100 run (the 944M transformer, fsdp_blocks, bf16; 0.213 s a step)
    bandwidth=0.61,
    launch_s=3e-6,
    # fitted: torchtitan's Llama 3.1 8B on 8 H100s, compiled per block against eager (6,667 / 5,762
    # tokens/s per GPU: the ratio, not either figure)
    fused_bytes=0.6,
    host_op_s=20e-6,
    calibrated_on="the project's H100 run (bandwidth), a measured 8192^3 product (matmul), "
    "FlashAttention-2's published H100 curve (attention), torchtitan's 8-GPU FSDP + compile row (fusion)",
)
# Other classes take Hopper's shares of their own datasheet: not calibrated (said in the plan).
CALIBRATIONS = {"hopper": HOPPER}
HOPPER_NAMES = ("H100", "H200", "GH200")


def calibration_of(device: Device) -> tuple[Calibration, bool]:
    """The device's calibration, and whether it was calibrated for that class."""
    if any(device.name.upper().startswith(n) for n in HOPPER_NAMES):
        return HOPPER, True
    return HOPPER, False


def _share(curve: tuple[tuple[int, float], ...], seq: int) -> float:
    """A published curve at this sequence length (linear between its points, flat outside)."""
    xs = [s for s, _ in curve]
    i = bisect.bisect_left(xs, seq)
    if i == 0:
        return curve[0][1] * seq / xs[0] if seq < xs[0] else curve[0][1]
    if i == len(xs):
        return curve[-1][1]
    (s0, t0), (s1, t1) = curve[i - 1], curve[i]
    return t0 + (t1 - t0) * (seq - s0) / (s1 - s0)


def _wave_share(m: int, n: int, sms: int = 132, tile: int = 128) -> float:
    """The share of the SMs' last wave a product's output tiles fill, over all its waves."""
    tiles = math.ceil(m / tile) * math.ceil(n / tile)
    return tiles / (math.ceil(tiles / sms) * sms)


def _arg(func: Any, args: Any, kwargs: dict[str, Any], name: str, default: Any) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else default)
    return default


@dataclass
class Costs:
    """Seconds by class, with what they are made of."""

    matmul_s: float = 0.0
    fp8_saved_s: float = 0.0  # what float8's products take off matmul_s
    attention_s: float = 0.0
    memory_s: float = 0.0
    memory_bytes: float = 0.0
    fused_bytes_saved: float = 0.0
    kernels: int = 0
    flops: float = 0.0
    cast_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)


class OpCosts(compat.TorchDispatchMode):
    """Each op of the fake step priced on `device` (the module's docstring).  `compiled` and
    `float8`: modules whose forward the run compiles / runs in float8 (hooks count the share of
    forward work inside them; the backward is taken to have the same share)."""

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device = device
        self.cal, self.calibrated = calibration_of(device)
        self.formulas = compat.flop_formulas()
        self.costs = Costs()
        self.inside = {"compiled": 0, "float8": 0}
        self.forward_done = False
        # forward-pass tallies for the shares: (all, inside compiled) element-wise bytes,
        # (all, inside float8 linears) matmul FLOPs
        self.fwd_bytes = [0.0, 0.0]
        self.fwd_mm = [0.0, 0.0]
        self.mm_fp8_share = 0.0

    def watch(self, model: torch.nn.Module, compiled: list[str], float8: list[str]) -> list[Any]:
        """Hooks that mark the forward of these modules (FQNs); returns their handles."""
        handles = []
        mods = dict(model.named_modules())
        for kind, fqns in (("compiled", compiled), ("float8", float8)):
            for fqn in fqns:
                if fqn in mods:
                    handles.append(mods[fqn].register_forward_pre_hook(lambda *_, k=kind: self._enter(k)))
                    handles.append(mods[fqn].register_forward_hook(lambda *_, k=kind: self._leave(k)))
        handles.append(model.register_forward_hook(lambda *_: setattr(self, "forward_done", True)))
        return handles

    def _enter(self, kind: str) -> None:
        self.inside[kind] += 1

    def _leave(self, kind: str) -> None:
        self.inside[kind] -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs first and comes back with its local ops
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in FREE or func.namespace != "aten":
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.costs.kernels += 1
        if name in MATMULS:
            self._matmul(func, args, kwargs, out, tensors)
        elif "scaled_dot_product" in name or "_efficient_attention" in name or "_flash_attention" in name:
            self._attention(func, args, kwargs, out, tensors, backward="backward" in name)
        else:
            moved = sum(t.numel() * t.element_size() for t in tensors)
            if not self.forward_done:
                self.fwd_bytes[0] += moved
                self.fwd_bytes[1] += moved if self.inside["compiled"] else 0
            self.costs.memory_bytes += moved
        return out

    def _flops(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> float:
        packet = func._overloadpacket
        return float(self.formulas[packet](*args, **kwargs, out_val=out)) if packet in self.formulas else 0.0

    def _matmul(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, tensors: list[torch.Tensor]) -> None:
        flops = self._flops(func, args, kwargs, out)
        self.costs.flops += flops
        d, c = self.device, self.cal
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        fp32 = bool(floats) and all(t == torch.float32 for t in floats)
        rows, cols = (out.shape[-2], out.shape[-1]) if out.dim() >= 2 else (1, out.numel())
        share = c.matmul * _wave_share(rows, cols)
        peak = d.fp32_flops if fp32 else d.bf16_flops
        moved = sum(t.numel() * t.element_size() for t in tensors)
        seconds = max(flops / (share * peak), moved / (c.bandwidth * d.memory_gbs * 1e9), c.launch_s)
        if not self.forward_done:
            self.fwd_mm[0] += flops
            if self.inside["float8"] and not fp32:
                self.fwd_mm[1] += flops
                # the casts of both operands: amax read, then read and written as float8
                a, b = args[0], args[1] if func._overloadpacket.__name__ != "addmm" else args[2]
                self.costs.cast_bytes += 5 * (a.numel() + b.numel())
        self.costs.matmul_s += seconds

    def _attention(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, tensors: list[torch.Tensor], backward: bool) -> None:
        flops = self._flops(func, args, kwargs, out)
        q = args[1] if backward else args[0]
        causal = bool(_arg(func, args, kwargs, "is_causal", False))
        real = flops / 2 if causal else flops
        self.costs.flops += flops
        d, c = self.device, self.cal
        if q.dtype == torch.float32:
            rate = c.fp32_attention * d.fp32_flops
        else:
            rate = _share(c.attention_bwd if backward else c.attention_fwd, q.shape[-2]) * d.bf16_flops
        moved = sum(t.numel() * t.element_size() for t in tensors)
        self.costs.attention_s += max(real / rate, moved / (c.bandwidth * d.memory_gbs * 1e9), c.launch_s)

    def totals(self) -> Costs:
        """The step's seconds by class, the compiled and float8 shares applied."""
        c, d, cal = self.costs, self.device, self.cal
        compiled = self.fwd_bytes[1] / self.fwd_bytes[0] if self.fwd_bytes[0] else 0.0
        saved = c.memory_bytes * compiled * (1 - cal.fused_bytes)
        casts = c.cast_bytes * 3  # forward's casts; the backward casts the gradient and both transposes
        casts *= (1 - compiled) + compiled * cal.fused_bytes
        moved = c.memory_bytes - saved + casts
        c.fused_bytes_saved = saved
        c.memory_s = max(moved / (cal.bandwidth * d.memory_gbs * 1e9), c.kernels * cal.launch_s)
        fp8 = self.fwd_mm[1] / self.fwd_mm[0] if self.fwd_mm[0] else 0.0
        fp8_peak = getattr(d, "fp8_flops", 0.0)
        if fp8 and fp8_peak:
            c.fp8_saved_s = c.matmul_s * fp8 * (1 - d.bf16_flops / fp8_peak)
            c.matmul_s -= c.fp8_saved_s
        self.mm_fp8_share = fp8
        return c
