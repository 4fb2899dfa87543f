"""Values the config's keys hold, read the way every part of composerun reads them: a class a
`_target_` names, a size in bytes, the mesh's dim names and sizes, the data-parallel replicas."""

from __future__ import annotations

import math
from typing import Any

from composerun.errors import ConfigError


def target_class(key: str, target: str) -> Any:
    """The class a `_target_` key names, or a ConfigError naming the key.  Hydra's get_class
    also logs each failure as an ERROR of several lines; that log is kept out of the way."""
    import logging

    from hydra.utils import get_class

    hydra_log = logging.getLogger("hydra.utils")
    before = hydra_log.disabled
    hydra_log.disabled = True
    try:
        return get_class(target)
    except Exception as e:  # hydra wraps import failures in several ways; say the cause's
        cause = e.__cause__ or e
        if isinstance(cause, ModuleNotFoundError) and cause.name == target and "." in target:
            module, name = target.rsplit(".", 1)  # the module imports, and has no such name
            raise ConfigError(f"{key}={target}: module {module} has no {name}") from None
        why = " ".join(str(cause).split()) or cause.__class__.__name__
        raise ConfigError(f"{key}={target}: cannot import it: {cause.__class__.__name__}: {why}") from None
    finally:
        hydra_log.disabled = before


def byte_size(text: str | int) -> int:
    """A size in bytes, or with a unit as Hugging Face writes it (5GB, 500MB, 2GiB); ValueError
    if it is neither, or below one byte."""
    units = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = str(text).strip().upper()
    unit = next((u for u in sorted(units, key=len, reverse=True) if u and number.endswith(u)), "")
    try:
        value = float(number[: len(number) - len(unit)]) * units[unit]
    except ValueError:
        raise ValueError(f"{text!r}: give bytes (1000000) or a size such as 5GB or 500MB") from None
    if not value >= 1:
        raise ValueError(f"{text!r}: must be at least 1 byte")
    return int(value)


def mesh_dim_names(shape: list[int], names: list[str] | None) -> list[str]:
    if names:
        return list(names)
    if len(shape) == 1:
        return ["shard"]
    if len(shape) == 2:
        return ["replicate", "shard"]
    return [f"dim{i}" for i in range(len(shape))]


def world_size_of(shape: list[int]) -> int:
    return math.prod(shape)


# Mesh dims over which ranks share their samples (tensor parallel: they split one model
# replica's work); every other dim is data-parallel.
NON_DATA_PARALLEL_DIMS = ("tp",)


def dp_size_of(shape: list[int], names: list[str] | None) -> int:
    """How many data-parallel replicas a mesh has: the product of its data-parallel dims."""
    dims = zip(mesh_dim_names(list(shape), names), shape, strict=True)
    return math.prod(n for name, n in dims if name not in NON_DATA_PARALLEL_DIMS)


def micro_batch_of(cfg: Any) -> int:
    """The samples one data-parallel replica runs in one forward and backward: the global
    batch over the replicas and the micro-batches of a step (at least 1: a planned mesh the
    batch does not split over still traces one sample per replica)."""
    return micro_batch_size(
        cfg.data.batch_size, dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names), cfg.train.grad_accum
    )


def micro_batch_size(batch_size: int, dp: int, grad_accum: int) -> int:
    """micro_batch_of's formula, for `dp` replicas (config/elastic.py keeps it across meshes)."""
    return max(1, batch_size // max(1, dp * grad_accum))


def ranks_per_node(shape: Any, nodes: Any, per_rank: Any = 1) -> int:
    """`${composerun.per_node:${mesh.shape},${launch.nodes}[,k]}` in hydra/launcher/slurm.yaml:
    the ranks each node runs (times k), so that SLURM's resources follow the mesh."""
    world = 1
    for n in shape:
        world *= int(n)
    nodes = int(nodes or 1)
    if nodes < 1 or world % nodes:
        raise ConfigError(f"a mesh of {world} ranks cannot be split evenly over launch.nodes={nodes}")
    return world // nodes * int(per_rank)
