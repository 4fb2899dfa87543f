"""Each rank's peak memory and time for export and init_from: composerun's (each rank writes
and reads its own rows of one safetensors file) against gathering the model on rank 0
(torch's full state dict on rank 0's CPU, written there; read there and scattered), which is
what composerun did before.

    torchrun --standalone --nproc_per_node 4 scripts/bench_export.py [--dim 2048] [--out DIR]

The model is CompositeModel (8 Linear layers of dim x dim) under fully_shard, in fp32: 128 MiB
at dim 2048.  Memory is each rank's peak resident set (VmHWM, reset before each call) above
what it held before the call.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from composerun.checkpoint import export
from composerun.models.reference import CompositeModel


def _status(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) // 1024  # MiB


def measured(fn, *args) -> tuple[float, int]:
    """(seconds, peak MiB above the resident set before) of fn(*args) on this rank."""
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    base, t0 = _status("VmRSS"), time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, _status("VmHWM") - base


def sharded(dim: int, mesh) -> torch.nn.Module:
    with torch.device("meta"):
        model = CompositeModel(dim)
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    return model


def gather_export(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
    dist.barrier()


def gather_init(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(path)) if dist.get_rank() == 0 else {}
    with torch.no_grad():
        for key, live in model.state_dict(keep_vars=True).items():
            full = sd[key] if dist.get_rank() == 0 else torch.empty(live.shape, dtype=live.dtype)
            if isinstance(live, DTensor):
                live.copy_(distribute_tensor(full, live.device_mesh, live.placements))  # scattered from rank 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--out", default=None, help="folder for the files (default: a temporary one)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    box = [args.out or (tempfile.mkdtemp(prefix="bench_export_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    out = Path(box[0])
    rows = []
    for name, write, read in (("rank 0 gathers", gather_export, gather_init), ("composerun", None, None)):
        path = out / f"{name.replace(' ', '_')}.safetensors"
        t_w, m_w = measured(write or export.export_safetensors, sharded(args.dim, mesh), path)
        t_r, m_r = measured(read or export.init_from, sharded(args.dim, mesh), path)
        rows.append((name, t_w, m_w, t_r, m_r))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        with torch.device("meta"):
            mib = sum(t.numel() * 4 for t in CompositeModel(args.dim).state_dict().values()) >> 20
        print(f"model {mib} MiB, {dist.get_world_size()} ranks; per rank: seconds, peak MiB above its resident set")
        for i, (name, *_) in enumerate(rows):
            cells = "  ".join(
                f"r{r}: {e[i][1]:.2f}s {e[i][2]:>4} MiB / {e[i][3]:.2f}s {e[i][4]:>4} MiB" for r, e in enumerate(every)
            )
            print(f"{name:<15} export / init_from  {cells}")
    dist.barrier()
    if dist.get_rank() == 0 and not args.out:
        shutil.rmtree(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
