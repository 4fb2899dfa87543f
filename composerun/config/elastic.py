"""The mesh rule of an elastic run (mesh.elastic=true): the mesh and the micro-batches per step
a run takes in a world of another size than mesh.shape's product, as torch's agents give it
after a node was lost or came back.

One dim absorbs the change (mesh.elastic_dim; by default the outermost data-parallel dim), and
every other dim, a tensor-parallel one and the in-node shard dim included, stays.  The global
batch (data.batch_size) never changes and neither do the samples of one micro-batch of one
replica: train.grad_accum grows as the replicas shrink (and shrinks as they grow back), so that
every step consumes the same samples in the same order (data/loader.py's micro_batch_order).
A world this cannot take is refused in one line."""

from __future__ import annotations

import math
from dataclasses import dataclass

from composerun.config.values import NON_DATA_PARALLEL_DIMS, dp_size_of, mesh_dim_names, micro_batch_size
from composerun.errors import ConfigError


@dataclass(frozen=True)
class ElasticMesh:
    """The mesh and gradient accumulation for one world, and the dim that changed."""

    shape: tuple[int, ...]
    grad_accum: int
    dim: str


def elastic_dim(shape: list[int], names: list[str] | None, given: str | None) -> str:
    """The dim that absorbs a change of the world: `given` (mesh.elastic_dim) or the outermost
    data-parallel dim; a tensor-parallel dim splits one replica and cannot."""
    dims = mesh_dim_names(list(shape), names)
    if given is not None:
        if given not in dims:
            raise ConfigError(f"mesh.elastic_dim={given}: the mesh's dims are {dims}; name one of them")
        if given in NON_DATA_PARALLEL_DIMS:
            raise ConfigError(
                f"mesh.elastic_dim={given}: a tensor-parallel dim splits each replica and stays; "
                f"name a data-parallel dim of {dims}"
            )
        return given
    for name in dims:
        if name not in NON_DATA_PARALLEL_DIMS:
            return name
    raise ConfigError(f"mesh.elastic=true: the mesh's dims {dims} have no data-parallel dim to grow or shrink")


def elastic_mesh(
    shape: list[int], names: list[str] | None, given: str | None, grad_accum: int, batch_size: int, world: int
) -> ElasticMesh:
    """The mesh of `world` ranks under the rule of the module's docstring, from the configured
    mesh `shape` (dim `names`) and its `grad_accum`; ConfigError of one line when the world is
    not a multiple of the dims that stay, or the global batch cannot be kept exactly."""
    dims = mesh_dim_names(list(shape), names)
    dim = elastic_dim(shape, names, given)
    i = dims.index(dim)
    kept = math.prod(n for j, n in enumerate(shape) if j != i)
    spelt = " * ".join(f"{d}={n}" for j, (d, n) in enumerate(zip(dims, shape, strict=True)) if j != i) or "1"
    if world < 1 or world % kept:
        raise ConfigError(
            f"mesh.elastic=true: a world of {world} ranks is not a multiple of the dims that stay "
            f"({spelt} = {kept}); only {dim} grows or shrinks: run on a multiple of {kept} ranks"
        )
    new = list(shape)
    new[i] = world // kept
    dp_before, dp_now = dp_size_of(list(shape), names), dp_size_of(new, names)
    micro = micro_batch_size(batch_size, dp_before, grad_accum)  # (validate() made it exact)
    accum, left = divmod(batch_size, dp_now * micro)
    if accum < 1 or left:
        raise ConfigError(
            f"mesh.elastic=true: a world of {world} ranks has {dp_now} data-parallel replicas, and "
            f"data.batch_size={batch_size} is not a whole number of their micro-batches of {micro} samples "
            f"(mesh.shape={list(shape)} with train.grad_accum={grad_accum}): the global batch cannot be kept; "
            f"pick a data.batch_size that is a multiple of {micro} x every replica count the run may have"
        )
    return ElasticMesh(tuple(new), accum, dim)


def change_line(shape: list[int], got: ElasticMesh, world: int, grad_accum: int, batch_size: int) -> str:
    """What rank 0 prints when the run takes a world of another size (every launcher the same)."""
    was, now = "x".join(map(str, shape)), "x".join(map(str, got.shape))
    return (
        f"composerun: mesh.elastic: a world of {world} ranks: mesh {was} -> {now} ({got.dim} changes), "
        f"train.grad_accum {grad_accum} -> {got.grad_accum}, data.batch_size {batch_size} kept"
    )


def node_range(nodes: int, min_nodes: int | None, elastic: bool) -> tuple[int, int] | None:
    """launch.min_nodes to launch.nodes, the node range of an elastic SLURM run (None: exactly
    launch.nodes); ConfigError of one line for a range that is none, or one without mesh.elastic."""
    if min_nodes is None or min_nodes == nodes:
        return None
    if not 1 <= min_nodes <= nodes:
        raise ConfigError(
            f"launch.min_nodes={min_nodes}: a node range is 1 <= launch.min_nodes <= launch.nodes ({nodes}); "
            "leave it out for exactly launch.nodes nodes"
        )
    if not elastic:
        raise ConfigError(
            f"launch.min_nodes={min_nodes} with launch.nodes={nodes} runs on fewer nodes than the mesh's: add "
            "mesh.elastic=true (the mesh for the nodes left: docs/clusters.md), or leave launch.min_nodes out"
        )
    return min_nodes, nodes


def check_node_range(
    shape: list[int], names: list[str] | None, given: str | None, grad_accum: int, batch_size: int, low: int, high: int
) -> None:
    """A node range (launch.min_nodes to launch.nodes, each node running mesh size / launch.nodes
    ranks): every world the agents may form must be one the rule takes, refused in one line
    before any rank starts, not when a node is lost."""
    per_node = math.prod(shape) // high
    for nodes in range(high - 1, low - 1, -1):
        try:
            elastic_mesh(shape, names, given, grad_accum, batch_size, nodes * per_node)
        except ConfigError as e:
            raise ConfigError(
                f"launch.min_nodes={low}: with {nodes} of launch.nodes={high} nodes left ({per_node} ranks each), {e}"
            ) from None
