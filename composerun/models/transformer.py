"""A small decoder-only transformer: enough structure (embedding, N identical blocks,
norm, head) for per-block sharding, activation checkpointing and throughput to mean
something, small enough to train on CPU in a test."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    """Causal self-attention.  Queries, keys and values have projections of their own, and
    the heads are counted from their outputs, so that tensor parallelism can give each rank
    whole heads of each (a fused qkv projection's rows would split across q, k and v)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def tp_plan(self, loss_parallel: bool = False) -> dict[str, Any]:
        """Tensor and sequence parallelism of a block (composerun/parallel/styles.py): the
        norms on sequence-sharded activations; attention and the MLP gather the sequence,
        split heads and hidden units, and reduce-scatter back to the sequence split."""
        gather = {"style": "prepare_input", "input_layouts": ["shard(1)"], "desired_input_layouts": ["replicate"]}
        return {
            "attn_norm": "sequence",
            "attn": gather,
            "attn.{q_proj,k_proj,v_proj}": "colwise",
            "attn.proj": {"style": "rowwise", "output_layouts": "shard(1)"},
            "mlp_norm": "sequence",
            "mlp": gather,
            "mlp.up": "colwise",
            "mlp.down": {"style": "rowwise", "output_layouts": "shard(1)"},
        }


class Transformer(nn.Module):
    def __init__(
        self, vocab_size: int = 256, dim: int = 64, n_layers: int = 4, n_heads: int = 4, max_seq_len: int = 256
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise TypeError(f"dim={dim} must be a multiple of n_heads={n_heads}")
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def tp_plan(self, loss_parallel: bool = False) -> dict[str, Any]:
        """Tensor parallelism outside the blocks: both embeddings split by rows and reduced
        to the sequence split (the token embedding's output along the sequence, dim 1; the
        position embedding's, of positions only, along dim 0), the final norm on that split,
        the head split by vocabulary (its logits sharded for the loss with `loss_parallel`)."""
        head = {"style": "colwise", "input_layouts": "shard(1)"}
        head.update({"output_layouts": "shard(-1)", "use_local_output": False} if loss_parallel else {"output_layouts": "replicate"})
        return {
            "tok_emb": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "shard(1)"},
            "pos_emb": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "shard(0)"},
            "norm": "sequence",
            "head": head,
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        # .clone(): FSDP2 warns on every forward when the root returns a view (an in-place op on
        # that view would skip FSDP's pre-backward hook)
        return self.head(self.norm(x)).clone()
