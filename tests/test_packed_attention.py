"""Packed documents' attention (data=sft's rows through composerun's Llama: a block-causal
boolean mask to scaled_dot_product_attention, models/llama.py; through +model=hf's transformers
model, the mask transformers builds from the position ids) keeps a fused kernel.

On a GPU, in bf16, the forward and backward run one of SDPA's fused kernels (the
memory-efficient one, or cuDNN's, which torch prefers on some Hopper set-ups; flash takes no
mask), never the math fallback, whose separate product and softmax kernels keep the batch x
heads x T x T scores; and the logits and gradients are the math path's within bf16's
rounding.  On the CPU the same run keeps SDPA's fused CPU kernel.  Which names are fused and
which are the math fallback (`sort_attention`) is checked on kernel names of each kind.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from composerun.data.sources import Packed, forward
from composerun.models.llama import Llama

# a fused attention kernel or op: memory-efficient (CUTLASS fmha), flash, cuDNN's, the CPU's
FUSED = re.compile(r"fmha|flash_(fwd|bwd)|efficient_attention|flash_attention|cudnn_attention|native_sdpa", re.I)
# the math fallback: its softmax kernels (forward and backward), its op
MATH = re.compile(r"softmax|attention_math", re.I)


def sort_attention(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the fused attention kernels or ops among `names`, those of the math fallback); a name
    that is fused is not the math fallback's whatever else it holds."""
    names = sorted(set(names))
    fused = [n for n in names if FUSED.search(n)]
    return fused, [n for n in names if MATH.search(n) and n not in fused]


def test_the_kernel_names_sort_as_fused_or_math() -> None:
    """Names as torch's profiler shows them: CUDA kernels of each SDPA backend, the ops."""
    fused = [
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_128x128_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x1x1_kernel0_0",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true>(Flash_fwd_params)",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ]
    math = [
        "void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 8, false, false>"
        "(c10::BFloat16*, c10::BFloat16 const*, int, int, int, bool const*, int, bool)",
        "void (anonymous namespace)::softmax_warp_backward<c10::BFloat16, c10::BFloat16, float, 8, false, false>(...)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, c10::BFloat16>(...)",
        "aten::_scaled_dot_product_attention_math",
        "aten::_safe_softmax",
    ]
    neither = [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8",  # (a product: cutlass, not fmha)
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
        "void at::native::elementwise_kernel<128, 2, ...>",
        "aten::scaled_dot_product_attention",
        "aten::bmm",
    ]
    assert sort_attention(fused + math + neither) == (sorted(fused), sorted(math))


def packed_position_ids(seq: int) -> torch.Tensor:
    """Two rows of documents of uneven lengths (one a single token), then padding: each
    token's position in its own document."""
    rows = [[37, 5, 90, 1, 60], [120, 3, 64]]
    out = []
    for lengths in rows:
        lengths = [*lengths, seq - sum(lengths)]  # (the rest: padding, a segment of its own)
        out.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(out)


def tiny(kind: str, seq: int) -> torch.nn.Module:
    """One block, 8 heads of 64 and 2 key/value heads: composerun's Llama, or transformers'
    LlamaForCausalLM as +model=hf builds it (sdpa attention, no key/value cache)."""
    torch.manual_seed(0)
    if kind == "llama":
        return Llama(vocab_size=256, dim=512, n_layers=1, n_heads=8, n_kv_heads=2, max_seq_len=seq)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq,
                                      attn_implementation="sdpa", use_cache=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def packed_step(device: str, seq: int, kind: str = "llama") -> dict[str, Any]:
    """`tiny(kind)` in bf16 on `device`: the forward (as a training step calls it: data/sources.py's
    `forward` of packed rows) and backward of two packed rows under torch's profiler, then again
    with SDPA's math backend only.  The names of the device's kernels (the ops' on the CPU) and of
    the ops, and both runs' logits and the attention's q_proj gradient."""
    model = tiny(kind, seq).to(device=device, dtype=torch.bfloat16)
    q_proj = next(m for name, m in model.named_modules() if name.endswith("self_attn.q_proj"))
    x = Packed(torch.randint(256, (2, seq), device=device), packed_position_ids(seq).to(device))
    weights = torch.randn(2, seq, 256, device=device)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        out = forward(model, x)
        logits = getattr(out, "logits", out)
        (logits.float() * weights).sum().backward()  # (no softmax of a loss among the kernels)
        return logits.detach().float(), q_proj.weight.grad.float()

    on_gpu = device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        logits, grad = step()
        if on_gpu:
            torch.cuda.synchronize()
    with sdpa_kernel([SDPBackend.MATH]):
        math_logits, math_grad = step()
    ops = [e.name for e in prof.events() if e.device_type == DeviceType.CPU]
    kernels = [e.name for e in prof.events() if e.device_type != DeviceType.CPU] if on_gpu else ops
    return {"kernels": kernels, "ops": ops, "logits": (logits, math_logits), "grad": (grad, math_grad)}


def check_fused(run: dict[str, Any], where: str) -> None:
    """A fused attention kernel among those that ran (on the CPU: the ops), nothing of the math
    fallback among them or the ops, and the logits and gradient the math path's."""
    assert run["kernels"], f"{where}: the profiler recorded no kernel (ops: {'; '.join(sorted(set(run['ops'])))})"
    fused, _ = sort_attention(run["kernels"])
    _, math = sort_attention(run["kernels"] + run["ops"])
    ran = "; ".join(sorted(set(run["kernels"])))
    assert fused, f"{where}: no fused attention kernel ran; the kernels that did: {ran}"
    assert not math, f"{where}: the math fallback ran ({', '.join(math)}); the kernels that did: {ran}"
    for what in ("logits", "grad"):
        got, want = run[what]
        diff, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert diff <= 2e-2 * scale, (
            f"{where}: the {what} differ from the math path's by {diff:.3g} (largest {scale:.3g})"
        )


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_packed_attention_keeps_the_cpus_fused_kernel(kind: str) -> None:
    check_fused(packed_step("cpu", 256, kind), f"{kind} on the CPU")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "hf"])
@pytest.mark.parametrize("seq", [256, 250])  # (250: the mask's rows not a multiple of 8 elements)
def test_packed_attention_keeps_a_fused_kernel_on_the_gpu(seq: int, kind: str) -> None:
    check_fused(packed_step("cuda", seq, kind), f"{kind} on {torch.cuda.get_device_name()}, T={seq}")
