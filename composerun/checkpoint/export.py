"""Full (unsharded) state dicts in and out of a sharded model.

`export_safetensors` gathers the model's full state dict on rank 0 through torch's
state-dict utilities and writes one safetensors file whose keys are the model's own
`state_dict()` keys (state-dict hooks and `_fqn_modifiers` respected).  `init_from` reads
such a file (or a torch file of tensors, loaded with weights_only) on rank 0, diffs its
keys and shapes against the model's first, and scatters it into the shards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from composerun.errors import CheckpointError, ConfigError


def full_state_dict_on_rank0(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (CPU); an empty dict on the other ranks."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every
    thread while it is read)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_safetensors(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically: a temporary file, fsync'd, then renamed into place."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # own, contiguous storage per tensor: safetensors refuses shared or strided memory
    # {"format": "pt"}: what Hugging Face's loaders require of a PyTorch safetensors file
    metadata = {**(metadata or {}), "format": "pt"}
    save_file({k: v.detach().clone().contiguous() for k, v in sd.items()}, str(tmp), metadata=metadata)
    # safetensors creates its file readable by its owner only; give it the mode any new file gets
    os.chmod(tmp, 0o666 & ~_umask())
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def export_safetensors(model: torch.nn.Module, path: Path, metadata: dict[str, str] | None = None) -> Path:
    sd = full_state_dict_on_rank0(model)
    if dist.get_rank() == 0:
        write_safetensors(sd, path, metadata)
    dist.barrier()
    return path


def read_full_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A flat dict of tensors from a safetensors file or a torch file (never unpickles objects)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint.init_from={path}: not a readable safetensors file ({e})") from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint.init_from={path}: not a readable torch file of tensors ({e})") from None
    return _tensors_of(sd, path)


def _tensors_of(sd: Any, path: Path) -> dict[str, torch.Tensor]:
    """The flat dict of tensors in what a torch file held (itself, or its `model` entry)."""
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"checkpoint.init_from={path}: expected a dict of tensors keyed by parameter name")
    return sd


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's key and shape in a full state dict file: a safetensors file's header only,
    a torch file memory-mapped (no tensor data is read)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint.init_from={path}: not a readable safetensors file ({e})") from None
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)  # torch's legacy format has no mmap
    except Exception as e:
        raise CheckpointError(f"checkpoint.init_from={path}: not a readable torch file of tensors ({e})") from None
    return {k: tuple(v.shape) for k, v in _tensors_of(sd, path).items()}


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


def init_from(model: torch.nn.Module, path: Path) -> None:
    """Load a full state dict from `path` on rank 0 into the (sharded) model on every rank.

    The file's keys are the model's own state_dict() keys.  Each entry goes straight into
    the live tensor that state_dict(keep_vars=True) returns under that key, scattered from
    rank 0 by DTensor's distribute_tensor; going through the tensors rather than
    load_state_dict also covers models whose state-dict hooks rename keys without
    declaring `_fqn_modifiers` (FusionEmbeddingWithHook), which torch's full-state-dict
    loader cannot map onto DTensor parameters."""
    targets = model.state_dict(keep_vars=True)
    want = {k: tuple(v.shape) for k, v in targets.items()}
    rank = dist.get_rank()
    sd: dict[str, Any] = {}
    verdict: list[Any] = [None]
    if rank == 0:
        try:
            sd = read_full_state_dict(path)
            check_fits(f"checkpoint.init_from={path}", {k: tuple(v.shape) for k, v in sd.items()}, want)
        except (ConfigError, CheckpointError) as e:
            verdict = [(type(e).__name__, str(e))]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        kind, msg = verdict[0]
        raise (ConfigError if kind == "ConfigError" else CheckpointError)(msg)
    with torch.no_grad():
        for key, live in targets.items():
            local = live.to_local() if isinstance(live, DTensor) else live
            full = sd[key] if rank == 0 else torch.empty(live.shape, dtype=local.dtype)
            full = full.to(device=local.device, dtype=local.dtype)
            if isinstance(live, DTensor):
                live.copy_(distribute_tensor(full, live.device_mesh, live.placements))  # scattered from rank 0
            else:
                if dist.get_world_size() > 1:
                    dist.broadcast(full, src=0)
                live.copy_(full)
