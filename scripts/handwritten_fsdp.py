"""The hand-written baseline that scripts/bench_cpu.py and scripts/bench_defaults.py compare
composerun against: what a user writes without a framework.

Plain torch, started by torchrun, nothing imported from composerun (importing the
`composerun.models` package would also import Hydra, and so slow this script's start-up):

    torchrun --standalone --nproc_per_node 8 scripts/handwritten_fsdp.py --dim 100 --steps 20 --out hw.json

By default it is the minimal script: torch's reference CompositeModel (composerun's
models/reference.py: l1, u1, u2, l2) built after `torch.manual_seed(0)`, fully_shard on each
top-level child and then the root over every rank as one 1-D mesh (composerun/configs/sharding/fsdp.yaml),
the regression samples of composerun's SyntheticData (sample i drawn from
Generator(seed * 1_000_003 + i); rank r takes samples [step*B + r*B/world, ...) of the global
batch B), MSE loss, torch's default AdamW(lr=1e-3, weight_decay=0) with a warmup-and-cosine LR
(composerun/configs/optim/adamw.yaml's), and nothing else: no clipping, no determinism, and the loss
all-reduced (for the benchmark's same-losses check) only after the first and last steps.

Each of composerun's defaults can be added, to measure what it costs or to do the same work:
`--log-every 1` (the loss all-reduced every step), `--clip 1.0` (grad-norm clipping),
`--fused` (AdamW's fused implementation, composerun/configs/optim/adamw.yaml), `--deterministic on`
(torch's deterministic algorithms, as composerun's CPU default: without filling new memory)
or `fill` (deterministic mode as torch sets it: every new tensor filled).

Step time is wall time from the start of a step to after `zero_grad`, as composerun measures it.

With --ckpt-dir it then times a plain `dcp.save` of {"model", "optim"} (the state-dict
utilities' FQN-keyed state dicts, as composerun saves them) and a `dcp.load` of it back
into the model and optimizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class UnitModule(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.seq(self.l1(x)))


class CompositeModel(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.u1 = UnitModule(dim)
        self.u2 = UnitModule(dim)
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.u2(self.u1(self.l1(x))))


def gen(seed: int, i: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + i)


def lr_at(step: int, total: int, lr: float = 1e-3, warm: int = 2, lo: float = 0.1) -> float:
    if step < warm:
        return lr * (step + 1) / (warm + 1)
    if total <= warm:
        return lr
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * frac)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--log-every", type=int, default=0, help="all-reduce the loss every N steps (0: first and last)")
    p.add_argument("--clip", type=float, default=0.0, help="clip the grad norm at this (0: no clipping)")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    p.add_argument("--deterministic", choices=["off", "on", "fill"], default="off")
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--ckpt-dir", default=None, help="also time a dcp.save and a dcp.load of the state here")
    p.add_argument("--out", required=True, help="rank 0 writes its timings here (JSON)")
    args = p.parse_args()

    if args.deterministic != "off":
        torch.use_deterministic_algorithms(True, warn_only=True)  # (this also turns on the fill)
        torch.utils.deterministic.fill_uninitialized_memory = args.deterministic == "fill"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    model, optim = build(args.dim, mesh, args.fused)

    g = gen(args.data_seed, -1)
    teacher = torch.randn(args.dim, args.dim, generator=g) / args.dim**0.5
    offset = torch.randn(args.dim, generator=g)
    micro = args.batch // world

    step_times, losses, first_step_end = [], {}, None
    for step in range(args.steps):
        t0 = time.perf_counter()
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps)
        base = step * args.batch + rank * micro
        x = torch.stack([torch.randn(args.dim, generator=gen(args.data_seed, i)) for i in range(base, base + micro)])
        y = 0.5 * (offset + torch.tanh(x @ teacher))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if step in (0, args.steps - 1) or (args.log_every and (step + 1) % args.log_every == 0):
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses[step + 1] = float(avg) / world
            if rank == 0:
                print(f"step {step + 1} loss {losses[step + 1]:.6f}", flush=True)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip, foreach=True)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        if first_step_end is None:
            first_step_end = time.time()

    out = {"world_size": world, "dim": args.dim, "step_s": step_times, "losses": losses, "args": vars(args)}
    out["first_step_end_unix"] = first_step_end
    if args.ckpt_dir:
        out.update(checkpoint(model, optim, args.ckpt_dir, lambda: build(args.dim, mesh, args.fused)))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def build(dim: int, mesh, fused: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = CompositeModel(dim)
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=fused or None)


def checkpoint(model: nn.Module, optim: torch.optim.Optimizer, path: str, fresh) -> dict[str, float]:
    """A plain DCP save and two loads (FileSystemWriter's default sync_files=True: the data
    files are fsync'd; the directory and the .metadata rename are not).  Each load goes into
    a freshly built model and optimizer, as a resumed run's does (and as composerun's resume,
    timed from a built model and optimizer, does): the optimizer's state is created by the
    state-dict utilities before it is filled.  The first load reads the files the save left
    in the page cache (warm); the second reads them from the disk (cold: dropped from the
    page cache first with posix_fadvise DONTNEED), as a resume on a fresh node does; read once
    from the disk before that, as bench_cpu's cold loads are: see its `prime`)."""
    dist.barrier()
    t0 = time.perf_counter()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    save_s = time.perf_counter() - t0
    del state, model, optim
    out = {"save_s": save_s}
    for kind in ("load_s", "cold_load_s"):
        model, optim = fresh()
        if kind == "cold_load_s" and dist.get_rank() == 0:
            # read once from the disk, then dropped: bench_cpu.prime says why
            for name in os.listdir(path):
                fd = os.open(os.path.join(path, name), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                while os.read(fd, 16 << 20):
                    pass
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        dist.barrier()
        t0 = time.perf_counter()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        dist.barrier()
        out[kind] = time.perf_counter() - t0
        del state, model, optim
    out["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return out


if __name__ == "__main__":
    main()
