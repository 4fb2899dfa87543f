"""The reference models of torch's composable-API tests, with the same module structure,
parameter names and shapes (torch.testing._internal.common_dist_composable and
.distributed.common_state_dict), so their state-dict keys match torch's own.

Three differences, all additive: the width is a constructor argument (default as in
torch); the models with parameters of their own have a `reset_parameters()` for them (so
they are built on the meta device, composerun/models/init.py); every model has a working
forward (torch's NestedSequentialModel defines its forward inside __init__ by mistake; the
Fusion embeddings have none).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class UnitModule(nn.Module):
    def __init__(self, dim: int = 100) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.seq(self.l1(x)))


class CompositeModel(nn.Module):
    def __init__(self, dim: int = 100) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.u1 = UnitModule(dim)
        self.u2 = UnitModule(dim)
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.u2(self.u1(self.l1(x))))


class UnitParamModule(nn.Module):
    def __init__(self, dim: int = 100) -> None:
        super().__init__()
        self.l = nn.Linear(dim, dim)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        # torch uses randn; scaled so that the product stays O(1) at any width
        self.p = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def reset_parameters(self) -> None:
        """This module's own parameter (its children reset theirs): what the constructor draws."""
        with torch.no_grad():
            self.p.normal_(0.0, self.p.shape[0] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.seq(self.l(x)), self.p)


class CompositeParamModel(nn.Module):
    def __init__(self, dim: int = 100) -> None:
        super().__init__()
        self.l = nn.Linear(dim, dim)
        self.u1 = UnitModule(dim)
        self.u2 = UnitModule(dim)
        self.p = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.register_buffer("buffer", torch.randn(dim, dim), persistent=True)

    def reset_parameters(self) -> None:
        """This module's own parameter and buffer (its children reset theirs)."""
        with torch.no_grad():
            self.p.normal_(0.0, self.p.shape[0] ** -0.5)
            self.buffer.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.u2(self.u1(self.l(x))), self.p)


class FakeSequential(nn.Module):
    """Holds its modules in a plain list, so they are *not* registered submodules:
    torch's test model uses this to get a particular traversal order, and their
    parameters are absent from the state dict (and not trained), exactly as there."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self._module_sequence = list(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self._module_sequence:
            x = module(x)
        return x


class NestedSequentialModel(nn.Module):
    """1 feature in, 4 out; the fixed widths are torch's (this model has no `dim`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(
            nn.Linear(1, 1),
            FakeSequential(nn.Linear(1, 1), nn.ReLU(), FakeSequential(nn.Linear(1, 1)), nn.ReLU()),
            nn.Linear(1, 2),
        )
        self.lin = nn.Linear(2, 2)
        self.seq2 = nn.Sequential(
            nn.ReLU(),
            nn.Linear(2, 3),
            FakeSequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 4, bias=False)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq2(self.lin(self.seq1(x)))


class FusionEmbedding(nn.Module):
    """Ids below vocab_size use `embedding`, the rest `fusion_embedding` (torchtune's
    fusion semantics); the output head is tied to both tables, so next-token prediction
    adds no parameters."""

    def __init__(self, vocab_size: int = 4, fusion_vocab_size: int = 4, dim: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim)
        self.fusion_embedding = nn.Embedding(fusion_vocab_size, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Both tables come out of their modules' own forwards (once each), never by
        # reading `.weight` directly, so FSDP units on the two embeddings stay correct.
        ids = lambda e: torch.arange(e.num_embeddings, device=tokens.device)  # noqa: E731
        table = torch.cat([self.embedding(ids(self.embedding)), self.fusion_embedding(ids(self.fusion_embedding))])
        return torch.nn.functional.embedding(tokens, table) @ table.t()


class FusionEmbeddingWithHook(FusionEmbedding):
    """State-dict hooks rename `embedding.weight` to `weight` (and back on load)."""

    def __init__(self, vocab_size: int = 4, fusion_vocab_size: int = 4, dim: int = 4) -> None:
        super().__init__(vocab_size, fusion_vocab_size, dim)
        self._register_state_dict_hook(FusionEmbeddingWithHook._state_dict_hook)
        self._register_load_state_dict_pre_hook(FusionEmbeddingWithHook._load_state_dict_hook, with_module=True)

    def _state_dict_hook(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = destination.pop(prefix + "embedding.weight")

    def _load_state_dict_hook(self, state_dict, prefix, *args, **kwargs):
        if state_dict:
            state_dict[prefix + "embedding.weight"] = state_dict.pop(prefix + "weight")


class FusionEmbeddingWithModifier(FusionEmbeddingWithHook):
    """Declares the rename through `_fqn_modifiers`, the contract torch's state-dict
    utilities read to map the renamed key back to the parameter's FQN."""

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"weight": "embedding"}
