"""The estimate's step time by op class (parallel/op_costs.py, parallel/step_time.py), each
class priced by hand here from the datasheet and the stated calibration and set beside what
the estimate adds up, on fake tensors (no memory, no arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import compose

from composerun import _torch_compat as compat
from composerun.devices import find_device
from composerun.parallel.op_costs import HOPPER, OpCosts
from composerun.parallel.planner import plan_offline

H100 = find_device("H100")


def _costs(fn, *shapes, dtype=torch.bfloat16, watch=None) -> OpCosts:
    with compat.fake_tensor_mode():
        args = [torch.empty(s, dtype=dtype) for s in shapes]
        costs = OpCosts(H100)
        if watch is not None:
            costs.watch(*watch)
        with costs:
            fn(*args)
    return costs


def test_a_large_product_runs_at_the_measured_share_less_the_last_wave() -> None:
    costs = _costs(torch.mm, (8192, 8192), (8192, 8192)).totals()
    # 64 x 64 output tiles of 128 x 128 over 132 SMs: 32 waves, the last one 4096 - 31 * 132 = 4 tiles
    share = 4096 / (32 * 132)
    assert costs.matmul_s == pytest.approx(2 * 8192**3 / (0.78 * share * 989.4e12))
    assert costs.attention_s == 0 and costs.memory_bytes == 0


def test_fp32_products_run_at_the_fp32_peak() -> None:
    bf16 = _costs(torch.mm, (4096, 4096), (4096, 4096)).totals().matmul_s
    fp32 = _costs(torch.mm, (4096, 4096), (4096, 4096), dtype=torch.float32).totals().matmul_s
    assert fp32 / bf16 == pytest.approx(H100.bf16_flops / H100.fp32_flops)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_does_half_the_work_under_a_causal_mask(causal: bool) -> None:
    def attend(q, k, v):
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    shape = (1, 8, 4096, 128)
    costs = _costs(attend, shape, shape, shape).totals()
    flops = 4 * 8 * 4096 * 4096 * 128 / (2 if causal else 1)
    # FlashAttention-2's forward on an H100 SXM at 4k: 319 TFLOP/s (the FlashAttention-3 paper)
    assert costs.attention_s == pytest.approx(flops / (319 / 989.4 * H100.bf16_flops))
    assert costs.matmul_s == 0


def test_memory_bound_ops_at_the_bandwidth_share() -> None:
    n = 1 << 26
    costs = _costs(torch.add, (n,), (n,)).totals()
    assert costs.memory_bytes == 3 * 2 * n  # two bf16 inputs read, one written
    assert costs.memory_s == pytest.approx(3 * 2 * n / (HOPPER.bandwidth * H100.memory_gbs * 1e9))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(1024, 1024, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.inner(x)) * x + 1


def _block_costs(compiled: list[str], float8: list[str]):
    with compat.fake_tensor_mode():
        model = _Block()
        x = torch.empty(4096, 1024, dtype=torch.bfloat16)
        costs = OpCosts(H100)
        costs.watch(model, compiled, float8)
        with costs:
            model(x)
    return costs.totals()


def test_a_compiled_module_moves_fewer_bytes_and_float8_products_run_at_the_fp8_peak() -> None:
    eager = _block_costs([], [])
    compiled = _block_costs([""], [])  # the whole forward compiled: every element-wise byte fused
    assert compiled.memory_bytes == eager.memory_bytes  # the same ops seen
    assert compiled.memory_s == pytest.approx(eager.memory_s * HOPPER.fused_bytes)
    assert compiled.matmul_s == pytest.approx(eager.matmul_s)
    fp8 = _block_costs([], ["inner"])
    # every product in float8: at the fp8 peak, and the two operands cast (5 bytes an element)
    assert fp8.matmul_s == pytest.approx(eager.matmul_s * H100.bf16_flops / H100.fp8_flops)
    assert fp8.cast_bytes == 5 * (4096 * 1024 + 1024 * 1024)


def test_the_step_counts_the_optimizer_by_implementation_and_the_host() -> None:
    base = ["+model=llama3_debug", "model.dim=64", "model.n_layers=2", "model.seq_len=32", "mesh=1",
            "data.batch_size=2", "plan.device=H100", "plan.search_batch=false"]  # fmt: skip
    fused = plan_offline(compose(*base))[0]["estimate"]["step_time"]
    loop = plan_offline(compose(*base, "optim.kwargs.fused=false"))[0]["estimate"]["step_time"]
    assert loop["optimizer_s"] / fused["optimizer_s"] == pytest.approx((80 + 12) / (28 + 12))
    # a tiny model: the host issuing its ops is slower than the GPU running them
    assert fused["host_s"] == pytest.approx(fused["kernels"] * HOPPER.host_op_s)
    assert fused["compute_s"] == fused["host_s"] > fused["matmul_s"] + fused["memory_bound_s"]
    assert math.isclose(fused["step_s"], fused["compute_s"])  # one rank: no collectives
