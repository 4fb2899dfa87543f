"""The global gradient norm over every mesh and placement a policy gives the gradients, for
clipping and the log, reduced in the training step's one all-reduce where it can be."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from composerun import _torch_compat as compat

# How a group of gradients (one mesh, placements, dtype and device) reaches the global norm:
FUSED = "fused"  # its squared norms ride the step's all-reduce (the group spans the default group)
LOCAL = "local"  # nothing to reduce: every rank holds every value (replicate, one rank, plain tensors)
SEPARATE = "separate"  # its own all-reduce over its own mesh's sharded dims (torch's DTensor norm)


@dataclass
class Group:
    kind: str
    params: list[torch.nn.Parameter] = field(default_factory=list)
    owner: bool = True  # fused: whether this rank's shards are the ones counted (replicas add zeros)


def _key(grad: torch.Tensor) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return (grad.device_mesh, tuple(grad.placements), grad.dtype, grad.device)
    return (None, (), grad.dtype, grad.device)


def _kind(grad: torch.Tensor, dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(how the group of `grad` is reduced, whether this rank owns its shards)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return LOCAL, True
    placements = grad.placements
    if not all(compat.shards(p) or isinstance(p, Replicate) for p in placements):
        return SEPARATE, True  # (a Partial gradient, say): torch's DTensor norm knows how to reduce it
    if not any(compat.shards(p) for p in placements):
        return LOCAL, True
    if grad.dtype != dtype or grad.device != device or grad.device_mesh.size() != dist.get_world_size():
        return SEPARATE, True
    # Each shard is held once per coordinate of the replicated dims: only coordinate 0 counts it.
    coordinate = grad.device_mesh.get_coordinate() or []
    return FUSED, all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))


class GradNorm:
    """The global 2-norm of the gradients, for clipping and the log, reduced in the step's
    one all-reduce (beside the loss and the stop flag) instead of one of its own.

    A policy may put units on different meshes (HSDP blocks under a root sharded over every
    rank) and a mesh may hold dims the gradients are replicated over, so the gradients are
    grouped by (mesh, placements, dtype, device), and each group is reduced over its own
    mesh's sharded dims only:

    - a group sharded over a mesh of every rank (FSDP, HSDP) rides the step's all-reduce:
      each gradient's squared norm over this rank's shard, from the ranks at coordinate 0 of
      the mesh's replicated dims (the others add zeros, so each shard counts once);
    - a group with nothing sharded (replicate, one rank, plain tensors) is whole on this rank:
      its norm is local (plain parameters left out of every unit, with
      sharding.require_coverage=false, are each rank's own, and so is their share);
    - any other group (a mesh that is not every rank, as under a tensor-parallel dim; another
      dtype or device than the all-reduce's, as CPU offload on a GPU; a placement other than
      Shard/Replicate) is reduced on its own by torch's DTensor norm, over its own mesh.

    The total is then torch's arithmetic: the 2-norm of the gradients' norms (a separate
    group's norm standing for its gradients'), so for one fused group (every run of one
    mesh) the norm is clip_grad_norm_'s, bit for bit.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], dtype: torch.dtype = torch.float32, device: torch.device | None = None
    ) -> None:
        """`dtype`, `device`: those of the all-reduce the shares ride in; the norm is returned
        on `device`."""
        self.params, self.device = params, torch.device(device or "cpu")
        by_key: dict[tuple[Any, ...], Group] = {}
        for p in params:  # groups in the parameters' order: the same on every rank
            key = _key(p.grad)
            if key not in by_key:
                kind, owner = _kind(p.grad, dtype, self.device)
                by_key[key] = Group(kind, owner=owner)
            by_key[key].params.append(p)
        self.groups = list(by_key.values())

    @property
    def mode(self) -> str:
        """fused (some group rides the step's all-reduce), separate (a group has its own
        collective, none rides) or local (no collective)."""
        kinds = {g.kind for g in self.groups}
        return FUSED if FUSED in kinds else SEPARATE if SEPARATE in kinds else LOCAL

    def covers(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether these are the parameters (those with gradients) it was made for."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params, strict=True))

    def shares(self) -> torch.Tensor | None:
        """This rank's terms of the step's all-reduce: each fused gradient's squared norm
        over this rank's shard (None: no group rides the all-reduce)."""
        parts = []
        for g in self.groups:
            if g.kind == FUSED:
                squares = torch.stack(compat.foreach_norm([p.grad.to_local() for p in g.params], 2.0)) ** 2.0
                parts.append(squares if g.owner else torch.zeros_like(squares))
        return torch.cat(parts) if parts else None

    def total(self, reduced: torch.Tensor | None) -> torch.Tensor:
        """The global norm, from the all-reduced shares and each other group's norm."""
        from torch.distributed.tensor import DTensor, Replicate

        norms, at = [], 0
        for g in self.groups:
            if g.kind == FUSED:
                assert reduced is not None
                norms.append(reduced[at : at + len(g.params)] ** (1.0 / 2.0))
                at += len(g.params)
                continue
            if g.kind == LOCAL:
                grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in g.params]
                norms.append(torch.stack(compat.foreach_norm(grads, 2.0)).to(self.device))
                continue
            norm = torch.nn.utils.get_total_norm([p.grad for p in g.params], 2.0, foreach=True)
            if isinstance(norm, DTensor):  # an all-reduce over the group's sharded dims
                norm = norm.redistribute(placements=[Replicate()] * norm.device_mesh.ndim).to_local()
            norms.append(norm.reshape(1).to(self.device))
        if not norms:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(norms[0] if len(norms) == 1 else torch.cat(norms), 2.0)

    def clip_(self, max_norm: float, norm: torch.Tensor) -> None:
        """Scale the gradients to a global norm of at most max_norm (0: leave them); group by
        group, as torch's foreach kernels take the gradients of one mesh at a time."""
        if max_norm > 0:
            for g in self.groups:
                torch.nn.utils.clip_grads_with_norm_(g.params, max_norm, norm, foreach=True)
