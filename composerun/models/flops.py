"""A model's training FLOPs per token (train/throughput.py's MFU, parallel/estimate.py's):
the model's own `flops_per_token(seq_len)` when it has one (the Llama's counts attention),
else 6 * N, N its parameters but those only an nn.Embedding uses (a lookup is no product)."""

from __future__ import annotations

import torch


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (module docstring): the model's own count, else 6 * N."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    return 6.0 * non_embedding_params(model)


def non_embedding_params(model: torch.nn.Module) -> int:
    """The model's parameters (each counted once, whole: a DTensor's global size) but those
    that only an nn.Embedding uses."""
    lookup, other = set(), set()
    for m in model.modules():
        for p in m.parameters(recurse=False):
            (lookup if isinstance(m, torch.nn.Embedding) else other).add(id(p))
    return sum(p.numel() for p in model.parameters() if id(p) not in lookup - other)
