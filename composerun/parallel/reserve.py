"""What a GPU rank needs beyond the tensors it holds: the estimate's reserve.

The fake step (parallel/estimate.py) measures what tensors hold at the step's peak, the
figure `torch.cuda.max_memory_allocated` reports.  A GPU needs more:

- inside PyTorch's caching allocator (`torch.cuda.max_memory_reserved`): blocks cached but
  not reusable for the next request (rounding of requests to the allocator's block sizes,
  split blocks that no later tensor fits: fragmentation), a share of the peak
  (`FRAGMENTATION`, less where the blocks are compiled: `FRAGMENTATION_COMPILED`); and the blocks FSDP's all-gather and reduce-scatter streams keep
  cached for themselves (the default stream cannot reuse a block another stream freed
  until that stream's work is done): one unit's all-gather output and reduce-scatter input;
- outside it (in nvidia-smi's figure, not in torch's): the CUDA context with the kernels
  of torch, cuBLAS and NCCL loaded (`CUDA_CONTEXT`), and NCCL's buffers, one set per
  communicator (`NCCL_PER_GROUP`: one per mesh dim, and the default group).

"Fits" and the largest micro-batch are decided against allocated + both.  The figures are
estimates (BENCHMARKS.md: which measurement set `FRAGMENTATION`, which checked it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from composerun.devices import GIB

# fitted: torchtitan's Llama 3.1 8B on 8 H100s (FSDP, selective AC): 82.4 GiB reserved; and the
# same compiled per block (77.0 GiB: the compiler's graphs allocate fewer, larger buffers, planned)
FRAGMENTATION = 0.19
FRAGMENTATION_COMPILED = 0.11
CUDA_CONTEXT = int(0.6 * GIB)  # the context plus torch's, cuBLAS's and NCCL's kernels (lazily loaded)
NCCL_PER_GROUP = int(0.25 * GIB)  # NCCL's channel buffers of one communicator (4 MiB per peer and channel)


def _unit_bytes(unit: dict[str, Any]) -> tuple[int, int]:
    """A unit's all-gather output (its parameters whole, in param_dtype) and reduce-scatter
    input (its gradients whole, in reduce_dtype) on one rank."""
    if "fully_shard" not in unit["apis"]:
        return 0, 0
    o = unit["options"]
    pdt = o.get("param_dtype")
    rdt = o.get("reduce_dtype") or pdt
    numel = [math.prod(p.get("tp_shape", p["shape"])) for p in unit["params"]]
    size = lambda dt, p: getattr(torch, dt or p["dtype"]).itemsize  # noqa: E731
    return (
        sum(n * size(pdt, p) for n, p in zip(numel, unit["params"], strict=True)),
        sum(n * size(rdt, p) for n, p in zip(numel, unit["params"], strict=True)),
    )


def fragmentation(report: dict[str, Any]) -> float:
    """The allocator's share beyond the peak for this plan: less where a module is compiled."""
    return FRAGMENTATION_COMPILED if any("compile" in u["apis"] for u in report["units"]) else FRAGMENTATION


def reserve(report: dict[str, Any], mesh_shape: list[int]) -> dict[str, Any]:
    """The fixed part of the reserve (bytes) for a plan: FSDP's stream pools, the CUDA
    context, NCCL's buffers; and the fragmentation share that scales with the peak."""
    block_units = [u for u in report["units"] if u["fqn"] != "<root>"] or report["units"]
    streams = max((sum(_unit_bytes(u)) for u in block_units), default=0)
    groups = (len(mesh_shape) + 1) if math.prod(mesh_shape) > 1 else 0
    return {
        "stream_pools": streams,
        "cuda_context": CUDA_CONTEXT,
        "nccl_buffers": groups * NCCL_PER_GROUP,
        "fragmentation_share": fragmentation(report),
    }


def reserved(allocated: int, fixed: dict[str, Any]) -> int:
    """torch.cuda.max_memory_reserved's estimate: the tensors, fragmentation, stream pools."""
    return int(allocated * (1 + fixed["fragmentation_share"])) + fixed["stream_pools"]


def needed(allocated: int, fixed: dict[str, Any]) -> int:
    """What the GPU must have free for the rank: reserved plus the context and NCCL."""
    return reserved(allocated, fixed) + fixed["cuda_context"] + fixed["nccl_buffers"]


def allocated_limit(limit: float, fixed: dict[str, Any]) -> float:
    """The largest allocated peak that still fits `limit` with the reserve."""
    rest = limit - fixed["cuda_context"] - fixed["nccl_buffers"] - fixed["stream_pools"]
    return rest / (1 + fixed["fragmentation_share"])
