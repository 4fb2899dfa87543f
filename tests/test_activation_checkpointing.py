"""What activation checkpointing keeps for backward, read off what backward recomputes.

An op whose output autograd keeps is not run again in backward; one whose output was
dropped runs again there.  So the ops of a backward, less those of the same backward with
no checkpointing (the gradient ops themselves), are exactly the forward's recomputed ops:
every forward op under full AC, the ones outside the save list under selective AC, none
without.  Counted by a dispatch mode under composerun's own policies (fully_shard per block,
on a 1-rank gloo mesh), in fp32 and in bf16 (FSDP's mixed precision: the input cast of its
pre-forward hook is no op of the block, and must stay out of the recomputation), and with
the gradients of every mode equal to those of no checkpointing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import compose
from torch.utils._python_dispatch import TorchDispatchMode

from composerun.models import build_model
from composerun.parallel import compile as compiling
from composerun.parallel.apply import apply_policy

LLAMA = ["+model=llama3_debug", "model.dim=64", "model.n_layers=2", "model.seq_len=16", "model.kwargs.ffn_dim=128"]
SHARD = "{match: 'layers.*', api: fully_shard}, {match: '<root>', api: fully_shard}"
POLICIES = {
    "none": ["sharding=fsdp_blocks"],
    "full": [f"sharding.rules=[{{match: 'layers.*', api: checkpoint, mode: full}}, {SHARD}]"],
    "selective": ["sharding=fsdp_blocks_sac"],
    # torchtitan's op-level policy: every second matmul of a block kept
    "every_2nd_mm": [f"sharding.rules=[{{match: 'layers.*', api: checkpoint, mode: selective, save_mm_every: 2}}, {SHARD}]"],
}
# what a selective policy must keep: the matmuls and the attention kernel of every block
KEPT = ("aten.mm", "aten._scaled_dot_product_flash_attention_for_cpu")


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is active, by packet name (aten.mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket._qualified_op_name).replace("::", ".")] += 1
        return func(*args, **(kwargs or {}))


def _step(mesh, policy: str, dtype: str) -> tuple[Counter[str], dict[str, torch.Tensor]]:
    """One forward and backward of the small Llama under `policy`: (backward ops, full gradients)."""
    cfg = compose(*LLAMA, *POLICIES[policy], *([f"sharding.param_dtype={dtype}"] if dtype != "float32" else []))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_policy(model, cfg.sharding, mesh)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(x).float().logsumexp(-1).mean()
    with OpCounter() as bwd:
        loss.backward()
    grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
    return bwd.ops, grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_recomputes_what_each_mode_drops(mesh, dtype: str) -> None:
    runs = {policy: _step(mesh, policy, dtype) for policy in POLICIES}
    base_bwd, base_grads = runs["none"]
    recomputed = {p: runs[p][0] - base_bwd for p in POLICIES}
    assert not +recomputed["none"]
    full, selective = recomputed["full"], recomputed["selective"]
    n_blocks = 2
    # full: every block op again, its matmuls and attention included
    # q, k, v, o, gate, up of each block (down's output is read by an addition only: the
    # recomputation stops before it)
    assert full["aten.mm"] == 6 * n_blocks, full
    assert full["aten._scaled_dot_product_flash_attention_for_cpu"] == n_blocks, full
    # selective: the matmuls and attention kept (not one run again), the cheap ops recomputed
    assert all(selective[op] == 0 for op in KEPT), selective
    assert selective["aten.silu"] == n_blocks and selective["aten.rsqrt"] >= n_blocks, selective
    # save_mm_every=2: of q, k, v, o, gate, up, down the 1st, 3rd, 5th and 7th kept; k, o and
    # up run again; everything else as selective
    halves = recomputed["every_2nd_mm"]
    assert halves["aten.mm"] == 3 * n_blocks, halves
    assert halves["aten._scaled_dot_product_flash_attention_for_cpu"] == 0, halves
    # full < selective < none in what is kept: each mode recomputes a strict superset's worth
    assert sum(full.values()) > sum(halves.values()) > sum(selective.values()) > 0
    for policy in ("full", "selective", "every_2nd_mm"):  # recomputing changes no gradient, bf16 included
        for name, g in runs[policy][1].items():
            torch.testing.assert_close(g, base_grads[name], rtol=0, atol=0, msg=f"{policy} {dtype} {name}")


def test_selective_keeps_a_max_for_float8_scales() -> None:
    """float8's scales are each tensor's amax: the default save list keeps aten.max, so the
    backward never recomputes it."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x @ self.w
            return (y / y.abs().max()).sin()

    plain, checkpointed = Scaled(), Scaled()
    checkpointed.load_state_dict(plain.state_dict())
    save_ops = sorted(compiling.resolve_ops("test", None))
    compiling.checkpoint_forward(checkpointed, {"mode": "selective", "save_ops": save_ops})
    x = torch.randn(4, 8)
    counts = {}
    for name, m in (("plain", plain), ("checkpointed", checkpointed)):
        out = m(x).sum()
        with OpCounter() as c:
            out.backward()
        counts[name] = c.ops
    recomputed = counts["checkpointed"] - counts["plain"]
    assert recomputed["aten.max"] == 0 and recomputed["aten.mm"] == 0, recomputed
    assert recomputed["aten.abs"] == recomputed["aten.div"] == 1, recomputed  # the rest recomputed: the policy ran
    torch.testing.assert_close(checkpointed.w.grad, plain.w.grad, rtol=0, atol=0)
