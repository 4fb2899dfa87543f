"""The process group and the device mesh, from the mesh config.

Device and backend default to cuda+nccl where a GPU is visible, else cpu+gloo.  On GPUs
the group is "cpu:gloo,cuda:nccl" so that CPU-side collectives (async checkpoint, object
gathers) have a backend too: DCP's async save refuses to run without a CPU backend.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from composerun.config.schema import NON_DATA_PARALLEL_DIMS, MeshConfig, mesh_dim_names
from composerun.errors import ConfigError


def pick_device(mcfg: MeshConfig) -> tuple[str, str]:
    dev = mcfg.device.value
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        raise ConfigError("mesh.device=cuda but no GPU is visible; use mesh.device=auto or cpu")
    backend = mcfg.backend.value
    if backend == "nccl" and dev != "cuda":
        raise ConfigError(
            f"mesh.backend=nccl runs on GPUs, but the mesh is on {dev}"
            + ("" if torch.cuda.is_available() else " (no GPU is visible)")
            + ": use mesh.backend=auto or gloo"
        )
    if backend == "auto":
        backend = "cpu:gloo,cuda:nccl" if dev == "cuda" else "gloo"
    return dev, backend


def shape_str(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def check_world_size(shape: list[int], world: int) -> None:
    if math.prod(shape) != world:
        raise ConfigError(
            f"mesh {shape_str(shape)} needs {' * '.join(map(str, shape))} = {math.prod(shape)} ranks "
            f"but WORLD_SIZE is {world}: pick a mesh of {world} ranks or launch {math.prod(shape)}"
        )


def init_mesh(mcfg: MeshConfig, timeout_s: float = 600) -> tuple[DeviceMesh, torch.device]:
    """Join (or create, for one in-process rank) the default group and build the mesh."""
    shape = list(mcfg.shape)
    check_world_size(shape, int(os.environ.get("WORLD_SIZE", "1")))
    dev, backend = pick_device(mcfg)
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # one rank in this process: a private store, so repeated jobs never share keys
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    names = mesh_dim_names(shape, mcfg.dim_names)
    mesh = init_device_mesh(dev, tuple(shape), mesh_dim_names=tuple(names))
    device = torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    return mesh, device


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among the data-parallel replicas: the samples it takes, the loss
    mean's divisor.  Ranks that differ only on a non-data-parallel dim (a `tp` dim) are one
    replica: they take the same samples, and only the first of them (`owner`) adds the
    replica's loss to the global sum."""

    rank: int
    size: int
    owner: bool


def data_parallel(mesh: DeviceMesh) -> DataParallel:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    rank, size, owner = 0, 1, True
    for name, n, c in zip(names, mesh.shape, coord, strict=True):
        if name in NON_DATA_PARALLEL_DIMS:
            owner = owner and c == 0
        else:
            rank, size = rank * n + c, size * n
    return DataParallel(rank, size, owner)


def teardown() -> None:
    """Success path only: a barrier first, so no rank tears gloo down under another (an abort at exit)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
