"""The global gradient norm over every mesh and placement a policy gives the gradients, for
clipping and the log, reduced in the training step's one all-reduce where it can be."""

from __future__ import annotations

import torch


class GradNorm:
    """The global 2-norm of the gradients, for clipping and the log, reduced in the step's
    one all-reduce (beside the loss and the stop flag) instead of one of its own.

    Under fully_shard every rank holds a shard of each gradient.  torch's norm of such
    DTensors (clip_grad_norm_) takes each gradient's norm over this rank's shard, squares
    them, all-reduces the vector of squares, takes their square roots and then the norm of
    those.  Here the vector of squares rides the step's all-reduce, and the rest is the same
    float operations in the same order: the norm is torch's, bit for bit.  On mesh dims
    where gradients are replicated (HSDP's replicate dim) only the ranks at coordinate 0
    add theirs (the others add zeros).  Where no gradient is sharded (one rank, `replicate`
    alone) the local norm is the global one and nothing is reduced; gradients of another
    layout (a mesh that is not every rank, several meshes or dtypes) are reduced on their
    own, as torch does.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], dtype: torch.dtype = torch.float32, device: torch.device | None = None
    ) -> None:
        """`dtype`, `device`: those of the all-reduce the shares ride in (gradients of another
        dtype, or on another device, as with CPU offload on a GPU, are reduced on their own,
        as torch does); the norm is returned on `device`."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.params, self.device = params, torch.device(device or "cpu")
        grads = [p.grad for p in params]
        self.mode, self.owner = "separate", True
        if not grads or not any(isinstance(g, DTensor) for g in grads):
            self.mode = "local"
            return
        if not all(isinstance(g, DTensor) for g in grads):
            return
        mesh, placements = grads[0].device_mesh, grads[0].placements
        if any(g.device_mesh != mesh or g.placements != placements or g.dtype != dtype for g in grads):
            return
        if any(g.device != self.device for g in grads):
            return
        if not all(isinstance(p, (Shard, Replicate)) for p in placements):
            return
        if not any(isinstance(p, Shard) for p in placements):
            self.mode = "local"
            return
        import torch.distributed as dist

        if mesh.size() != dist.get_world_size():
            return
        self.mode = "fused"
        coordinate = mesh.get_coordinate() or []
        self.owner = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))

    def covers(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether these are the parameters (those with gradients) it was made for."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params, strict=True))

    def shares(self) -> torch.Tensor | None:
        """This rank's terms of the step's all-reduce: each gradient's squared norm over this
        rank's shard (None: the norm is not reduced there)."""
        if self.mode != "fused":
            return None
        squares = torch.stack(torch._foreach_norm([p.grad.to_local() for p in self.params], 2.0)) ** 2.0
        return squares if self.owner else torch.zeros_like(squares)

    def total(self, reduced: torch.Tensor | None) -> torch.Tensor:
        """The global norm, from the all-reduced shares (or reduced here, or local)."""
        if self.mode == "fused":
            assert reduced is not None
            return torch.linalg.vector_norm(reduced ** (1.0 / 2.0), 2.0)
        from torch.distributed.tensor import DTensor, Replicate

        if not self.params:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params], 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.redistribute(placements=[Replicate()] * norm.device_mesh.ndim).to_local()
        return norm.to(self.device)

    def clip_(self, max_norm: float, norm: torch.Tensor) -> None:
        """Scale the gradients to a global norm of at most max_norm (0: leave them)."""
        if max_norm > 0 and self.params:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm, foreach=True)
