"""The Llama 3 family: RMSNorm, rotary embeddings (with Llama 3.1's frequency scaling as an
option), grouped-query attention through `scaled_dot_product_attention`, a SwiGLU MLP, tied or
untied embeddings.

Module and parameter names are Hugging Face's `LlamaForCausalLM` names without its `model.`
prefix (`embed_tokens`, `layers.N.self_attn.q_proj`, ..., `norm`, `lm_head`), and the rotary
embedding rotates halves of each head as transformers does, so a Hugging Face checkpoint's
tensors load as they are (no permutation of q/k rows): models/hf.py maps the names.  The
blocks the sharding rules see are `layers.N` (class `LlamaBlock`).  Given `position_ids`
(data=sft's packed rows), the rotary positions are those and attention is block-causal: each
token sees the earlier tokens of its own document only (`document_mask`, SDPA's boolean mask).  With tied embeddings there
is no `lm_head` module: the output projection is the embedding's own weight, one parameter.

Every module with tensors of its own has a `reset_parameters()` that sets them all (the rotary
table included), so the model is built on the meta device and each rank makes only its shards
(models/init.py).  Initial weights: N(0, init_std) for embeddings and projections, the output
projections of each block (o_proj, down_proj) scaled by 1/sqrt(2 * n_layers) (GPT-2's
residual scaling), norms at 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Linear(nn.Linear):
    """A bias-free projection initialized N(0, std)."""

    def __init__(self, d_in: int, d_out: int, std: float) -> None:
        self.std = std
        super().__init__(d_in, d_out, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)


class Embedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int, std: float) -> None:
        self.std = std
        super().__init__(vocab_size, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)

    def forward(self, x: torch.Tensor, project: bool = False) -> torch.Tensor:
        """The embedding of token ids, or with `project`, hidden states times the table's
        transpose (tied output logits).  Through forward either way, so that a data-parallel
        API applied to this module alone gathers its weight for both uses."""
        return F.linear(x, self.weight) if project else super().forward(x)


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The rotary embedding's inverse frequencies; with `scaling` of type llama3, Llama 3.1's
    smooth stretch of the low frequencies (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise TypeError(f"rope_scaling type {kind!r}: composerun's Llama has default and llama3 rotary embeddings")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """The rotary embedding's frequency table (a buffer, not saved: it follows from the config)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(rope_frequencies(self.head_dim, self.theta, self.scaling))

    def forward(
        self, seq_len: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..seq_len-1 (seq_len x head_dim), or of each row's
        `position_ids` (batch x 1 x seq_len x head_dim: broadcast over the heads)."""
        if position_ids is None:
            pos = torch.arange(seq_len, device=self.inv_freq.device).float()
        else:
            pos = position_ids.to(self.inv_freq.device).float()[:, None, :]
        freqs = pos[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The block-causal mask of packed documents (batch x 1 x T x T, True where a query may
    attend to a key): a token sees the tokens before it in its own document only.  A document
    starts where its position is 0."""
    doc = (position_ids == 0).cumsum(dim=1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, std: float, out_std: float) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = Linear(dim, n_heads * head_dim, std)
        self.k_proj = Linear(dim, n_kv_heads * head_dim, std)
        self.v_proj = Linear(dim, n_kv_heads * head_dim, std)
        self.o_proj = Linear(n_heads * head_dim, dim, out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`mask`: packed documents' block-causal mask (`document_mask`), or None: causal."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = _kv_for_sdpa(q, k, v, mask is not None)
        gqa = k.shape[1] != q.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _kv_for_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value heads as SDPA takes them with a fused kernel.  On a GPU, SDPA's grouped-query
    path (`enable_gqa`) has two kernels: flash, which needs fp16/bf16, and math, which keeps the
    batch x heads x T x T scores for backward.  In any other dtype each kv head is repeated for its
    group of query heads (the memory-efficient kernel takes fp32, not enable_gqa).  Chosen by dtype
    alone, so the estimate's fake step (on the CPU) runs, and counts, what a GPU runs.

    With a mask (packed documents) flash is out whatever the dtype (it takes no mask but the
    causal one): SDPA's fused kernel for a boolean mask is the memory-efficient one, which takes
    no enable_gqa, so the kv heads are repeated then too."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or (q.dtype in (torch.float16, torch.bfloat16) and not masked):
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, std: float, out_std: float) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden, std)
        self.up_proj = Linear(dim, hidden, std)
        self.down_proj = Linear(hidden, dim, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, hidden: int, eps: float, std: float, out_std: float) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(dim, n_heads, n_kv_heads, head_dim, std, out_std)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, hidden, std, out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def tp_plan(self, loss_parallel: bool = False) -> dict[str, Any]:
        """Tensor and sequence parallelism of a block (composerun/parallel/styles.py;
        Megatron's layout, as torchtitan's): the norms run on sequence-sharded activations,
        attention and the MLP gather the sequence, split their heads and hidden units
        (q/k/v, gate/up by output features), and reduce-scatter back to the sequence split
        (o_proj, down_proj by input features)."""
        gather = {"style": "prepare_input", "input_layouts": ["shard(1)"], "desired_input_layouts": ["replicate"]}
        return {
            "input_layernorm": "sequence",
            "self_attn": {
                **gather,
                "input_layouts": ["shard(1)", None, None, None],  # x, cos, sin, the documents' mask
                "desired_input_layouts": ["replicate", None, None, None],
            },
            "self_attn.{q_proj,k_proj,v_proj}": "colwise",
            "self_attn.o_proj": {"style": "rowwise", "output_layouts": "shard(1)"},
            "post_attention_layernorm": "sequence",
            "mlp": gather,
            "mlp.{gate_proj,up_proj}": "colwise",
            "mlp.down_proj": {"style": "rowwise", "output_layouts": "shard(1)"},
        }


class Llama(nn.Module):
    """A Llama 3 decoder.  `ffn_dim` is the MLP's hidden size (Hugging Face's
    intermediate_size); `head_dim` defaults to dim // n_heads; `n_kv_heads` (grouped-query
    attention) to n_heads; `rope_scaling` is Hugging Face's dict (rope_type llama3 and its
    factors) or null."""

    def __init__(
        self,
        vocab_size: int = 2048,
        dim: int = 256,
        n_layers: int = 4,
        n_heads: int = 8,
        n_kv_heads: int | None = None,
        ffn_dim: int | None = None,
        head_dim: int | None = None,
        norm_eps: float = 1e-5,
        rope_theta: float = 500000.0,
        rope_scaling: dict[str, Any] | None = None,
        max_seq_len: int = 2048,
        tie_embeddings: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        head_dim = head_dim or dim // n_heads
        if n_heads % n_kv_heads:
            raise TypeError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if not head_dim or head_dim % 2:
            raise TypeError(f"head_dim={head_dim} (dim={dim} / n_heads={n_heads}) must be even")
        self.vocab_size, self.dim, self.n_layers, self.max_seq_len = vocab_size, dim, n_layers, max_seq_len
        self.n_heads, self.head_dim, self.tie_embeddings = n_heads, head_dim, tie_embeddings
        out_std = init_std / math.sqrt(2 * n_layers)
        hidden = ffn_dim or 4 * dim
        self.embed_tokens = Embedding(vocab_size, dim, init_std)
        self.rotary = Rotary(head_dim, rope_theta, dict(rope_scaling) if rope_scaling else None)
        self.layers = nn.ModuleList(
            LlamaBlock(dim, n_heads, n_kv_heads, head_dim, hidden, norm_eps, init_std, out_std) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.lm_head = None if tie_embeddings else Linear(dim, vocab_size, init_std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `tokens`; with `position_ids` (packed documents: each token's position in
        its own document, 0 at a document's first), rotary positions from them and attention
        within each document only (`document_mask`)."""
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"a sequence of {tokens.shape[1]} tokens is longer than max_seq_len={self.max_seq_len}")
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(tokens.shape[1], h.dtype, position_ids)
        mask = None if position_ids is None else document_mask(position_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        h = self.norm(h)
        # .clone(): FSDP2 warns on every forward when the root returns a view (an in-place op on
        # that view would skip FSDP's pre-backward hook)
        return (self.embed_tokens(h, project=True) if self.lm_head is None else self.lm_head(h)).clone()

    def tp_plan(self, loss_parallel: bool = False) -> dict[str, Any]:
        """Tensor parallelism of what lies outside the blocks: the embedding split by
        vocabulary rows, its output reduce-scattered to the sequence split the blocks take;
        the final norm on that split; the output head split by vocabulary, its logits left
        sharded for the loss (`loss_parallel`) or gathered whole."""
        if self.lm_head is None:
            raise ValueError(
                "tied embeddings (model.kwargs.tie_embeddings=true: the embedding table is also the output head) "
                "cannot be split for both; tensor parallelism needs untied ones (llama3_8b, llama3_debug)"
            )
        head = {"style": "colwise", "input_layouts": "shard(1)"}
        head.update({"output_layouts": "shard(-1)", "use_local_output": False} if loss_parallel else {"output_layouts": "replicate"})
        return {
            "embed_tokens": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "shard(1)"},
            "norm": "sequence",
            "lm_head": head,
        }

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter (forward 2, backward 4), the output
        projection included and the embedding lookup not, plus the
        attention scores and their weighted sum, 12 * n_layers * n_heads * head_dim * seq_len
        (PaLM's appendix B; torchtitan's count).  Causal masking's saving is not subtracted."""
        dense = sum(p.numel() for p in self.parameters()) - self.embed_tokens.weight.numel()
        dense += self.vocab_size * self.dim if self.lm_head is None else 0  # the tied table's output use
        return 6.0 * dense + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len
