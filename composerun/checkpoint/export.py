"""Full (unsharded) state dicts in and out of a sharded model, with no rank holding the model.

`export_safetensors` writes one safetensors file whose keys are the model's own
`state_dict()` keys (state-dict hooks and `_fqn_modifiers` respected), the same file
`safetensors.torch.save_file` would write of the full state dict; but nothing is gathered:
rank 0 writes the header (keys, dtypes, shapes: known to every rank), and each rank writes
the rows of dim 0 it holds straight into their place in the file (safetensors_io.py).  Under
FSDP every rank holds 1/N of every parameter, so each writes 1/N of the model; HSDP's
replicas leave it to the first; tensors every rank holds whole (replicate, buffers) are
dealt out among the ranks by size.

`init_from` reads such a file, a Hugging Face index of several (`model.safetensors.index.json`)
or a torch file of tensors: rank 0 checks its keys and shapes against the model's first,
then each rank reads only the rows it holds (safetensors' `get_slice`; a torch file is
memory-mapped) into its shards; nothing is scattered.

A placement that shards another dim than 0 (tensor parallelism's column split) has no
contiguous rows: such a tensor is gathered whole (DTensor.full_tensor) for the export, and
read whole for init_from, one tensor at a time.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from composerun.checkpoint.safetensors_io import Source, create, layout, write_at
from composerun.errors import CheckpointError, ConfigError
from composerun.models.lora import is_adapter_key


def full_state_dict_on_rank0(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (CPU); an empty dict on the other ranks (verification only)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict() tensors under its own keys, live (sharded ones stay DTensors)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def row_runs(t: DTensor) -> list[tuple[int, int]] | None:
    """The rows [start, stop) of dim 0 whose values this rank holds, in its local tensor's
    order; None when a placement splits another dim.  DTensor's own split of an index
    says which rows (no communication: each rank cuts its own copy)."""
    if t.dim() == 0 or not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in t.placements):
        return None
    index = distribute_tensor(torch.arange(t.shape[0]), t.device_mesh, list(t.placements), src_data_rank=None)
    rows = index.to_local().tolist()
    if len(rows) != t.to_local().shape[0]:
        return None
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


class RowPiece:
    """A tensor to write that is a piece of one row of a (sharded) model tensor: of row `row`
    of dim 0, the slice [start, stop) along the row's dim `dim` (one expert's projection of a
    layer's fused experts, as a Hugging Face directory stores it).  The rank that holds the
    row writes it (its first replica); a row split along another dim is gathered first."""

    def __init__(self, parent: torch.Tensor, row: int, dim: int, start: int, stop: int) -> None:
        self.parent, self.row, self.dim, self.start, self.stop = parent, row, dim, start, stop
        shape = list(parent.shape[1:])
        shape[dim] = stop - start
        self.shape, self.dtype = torch.Size(shape), parent.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.parent.element_size()

    def cut(self, row: torch.Tensor) -> torch.Tensor:
        return row.narrow(self.dim, self.start, self.stop - self.start).contiguous()


def _first_replica(t: DTensor) -> bool:
    """Whether this rank's shard is the one copy to write (coordinate 0 of every replicated dim)."""
    coordinate = t.device_mesh.get_coordinate() or []
    return all(c == 0 for c, p in zip(coordinate, t.placements, strict=True) if isinstance(p, Replicate))


def _layouts(tensors: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, int]] | None]:
    """For each tensor sharded by rows: this rank's runs of rows; None for one held whole
    (replicate, a buffer) or split along another dim."""
    out: dict[str, list[tuple[int, int]] | None] = {}
    parents: dict[int, list[tuple[int, int]] | None] = {}  # (a RowPiece's: its parent's, once)
    for key, t in tensors.items():
        whole = t.parent if isinstance(t, RowPiece) else t
        if id(whole) not in parents:
            sharded = isinstance(whole, DTensor) and any(isinstance(p, Shard) for p in whole.placements)
            parents[id(whole)] = row_runs(whole) if sharded else None
        out[key] = parents[id(whole)]
    return out


def _dealt(tensors: dict[str, torch.Tensor], runs: dict[str, Any], world: int) -> dict[str, int]:
    """The rank that writes each tensor not sharded by rows: the least loaded so far."""
    load, out = [0] * world, {}
    for key, t in tensors.items():
        if runs[key] is None:
            r = min(range(world), key=load.__getitem__)
            out[key] = r
            load[r] += t.numel() * t.element_size()
    return out


def _pieces(t: torch.Tensor, runs: list[tuple[int, int]] | None, writer: int, at: int) -> list[Any]:
    """(tensor, file offset) of what this rank writes of `t`, which starts at `at` in the file."""
    if isinstance(t, RowPiece):
        if runs is None:  # the parent whole (gathered where another dim is split), its row cut
            return [(t.cut(whole[t.row]), at) for whole, _ in _pieces(t.parent, None, writer, 0)]
        if not _first_replica(t.parent):
            return []
        i = 0
        for a, b in runs:  # the row's place in the local shard, if this rank holds it
            if a <= t.row < b:
                return [(t.cut(t.parent.to_local()[i + t.row - a]), at)]
            i += b - a
        return []
    if runs is not None:  # rows: the first replica's shard, run by run
        if not _first_replica(t):
            return []
        local, row, out, i = t.to_local(), math.prod(t.shape[1:]) * t.element_size(), [], 0
        for a, b in runs:
            out.append((local[i : i + b - a], at + a * row))
            i += b - a
        return out
    if isinstance(t, DTensor):  # whole: a gather where another dim is split (every rank takes part)
        t = t.full_tensor() if any(isinstance(p, Shard) for p in t.placements) else t.to_local()
    return [(t, at)] if writer == dist.get_rank() else []


def _write_mine(path: Path, tensors: dict[str, torch.Tensor], offsets: dict[str, int]) -> tuple[int, str | None]:
    """Write this rank's part of the file: (bytes written, the first error).  Every rank goes
    through every tensor even after an error, so that the gathers of whole tensors match."""
    runs = _layouts(tensors)
    writer = _dealt(tensors, runs, dist.get_world_size())
    err, written, fd = None, 0, -1
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        err = str(e)
    for key, t in tensors.items():
        for piece, at in _pieces(t, runs[key], writer.get(key, -1), offsets[key]):
            if err is None and piece.numel():
                try:
                    written += write_at(fd, piece, at)
                except OSError as e:
                    err = str(e)
    if fd >= 0:
        try:
            os.fsync(fd)
        except OSError as e:
            err = err or str(e)
        os.close(fd)
    return written, err


def agree(err: str | None, what: str) -> None:
    """Every rank raises the first rank's error, or none does."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(f"{what}: {first}")


def write_in_place(files: dict[Path, dict[str, torch.Tensor]], metadata: dict[str, str], what: str) -> None:
    """Safetensors files (each path: its tensors, under the keys it stores them), written by
    every rank: rank 0 creates each with its header, then each rank writes its part of each.
    Every rank raises the first rank's error, or none does; the caller publishes (and removes
    what a failure leaves)."""
    laid = {path: layout({k: (t.dtype, tuple(t.shape)) for k, t in ts.items()}, metadata) for path, ts in files.items()}
    err = None
    if dist.get_rank() == 0:
        try:
            for path, (head, _, size) in laid.items():
                create(path, head, size)
        except OSError as e:
            err = str(e)
    agree(err, what)
    for path, tensors in files.items():  # every rank every file, even after an error (the gathers match)
        _, mine = _write_mine(path, tensors, laid[path][1])
        err = err or mine
    agree(err, what)


def export_safetensors(model: torch.nn.Module, path: Path, metadata: dict[str, str] | None = None) -> Path:
    """The model's full state dict as one safetensors file at `path` (metadata `format: pt`,
    which Hugging Face's loaders require), written by every rank; published atomically (a
    failed export leaves neither the file nor its temporary)."""
    tmp, what = path.with_name(path.name + ".tmp"), f"exporting the model to {path}"
    err = None
    try:
        write_in_place({tmp: model_tensors(model)}, {**(metadata or {}), "format": "pt"}, what)
        if dist.get_rank() == 0:
            try:
                tmp.replace(path)
            except OSError as e:
                err = str(e)
        agree(err, what)
    except CheckpointError:
        if dist.get_rank() == 0:
            tmp.unlink(missing_ok=True)
        raise
    return path


def read_full_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A flat dict of tensors from a safetensors file, an index of several, or a torch file
    (never unpickles objects): for one process that needs the whole model (verification)."""
    src = Source(path, f"checkpoint.init_from={path}")
    return {k: src.read(k) for k in src.where}


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's key and shape: safetensors headers only, a torch file memory-mapped."""
    return Source(path, f"checkpoint.init_from={path}").shapes()


def check_fits(what: str, have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> None:
    """ConfigError unless `have` holds exactly the keys of `want`, with their shapes."""
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise ConfigError(
            f"{what} does not fit the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    shapes = [f"{k} {tuple(have[k])} != {tuple(want[k])}" for k in want if tuple(have[k]) != tuple(want[k])]
    if shapes:
        raise ConfigError(f"{what} does not fit the model: shapes {shapes[:3]}")


def _opened(path: Path, want: dict[str, tuple[int, ...]]) -> Source:
    """The file on every rank, once rank 0 has found that it fits the model (one error for all)."""
    what = f"checkpoint.init_from={path}"
    verdict: list[Any] = [None]
    src = None
    if dist.get_rank() == 0:
        try:
            src = Source(path, what)
            check_fits(what, src.shapes(), want)
        except (ConfigError, CheckpointError) as e:
            verdict = [(type(e).__name__, str(e))]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        kind, msg = verdict[0]
        raise (ConfigError if kind == "ConfigError" else CheckpointError)(msg)
    return src if src is not None else Source(path, what)


def init_from(model: torch.nn.Module, path: Path) -> None:
    """Load a full state dict from `path` into the (sharded) model: each rank reads the rows
    of each tensor that it holds, and copies them into its shards.

    The file's keys are the model's own state_dict() keys; each entry goes straight into the
    live tensor that state_dict(keep_vars=True) returns under that key, which also covers
    models whose state-dict hooks rename keys without declaring `_fqn_modifiers`
    (FusionEmbeddingWithHook), which torch's full-state-dict loader cannot map."""
    targets = {k: v for k, v in model_tensors(model).items() if not is_adapter_key(k)}  # (the base's: models/lora.py)
    src = _opened(path, {k: tuple(v.shape) for k, v in targets.items()})
    fill(targets, src)


def fill(targets: dict[str, torch.Tensor], src: Source, name: Any = str) -> None:
    """Copy into each live tensor (model_tensors) its part of the file's tensor `name(key)`:
    the rows of dim 0 this rank holds, read alone; whole where a placement splits another dim
    (hf_import.py reads Hugging Face names through this)."""
    with torch.no_grad():
        for key, live in targets.items():
            local = live.to_local() if isinstance(live, DTensor) else live
            runs = row_runs(live) if isinstance(live, DTensor) else [(0, live.shape[0])] if live.dim() else None
            if runs is None:  # read whole; DTensor cuts this rank's part of its own copy
                full = src.read(name(key)).to(device=local.device, dtype=local.dtype)
                if isinstance(live, DTensor):
                    full = distribute_tensor(full, live.device_mesh, list(live.placements), src_data_rank=None)
                    full = full.to_local()
                local.copy_(full)
                continue
            at, into = 0, getattr(src, "read_into", None)  # (hf_import's reader: straight into the shard)
            for a, b in runs:
                dest = local[at : at + b - a]
                if into is None or not into(name(key), (a, b), dest):
                    dest.copy_(src.read(name(key), (a, b)))
                at += b - a
