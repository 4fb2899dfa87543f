"""Host memory a rank needs to set a model up: composerun (built on the meta device, each rank
making only its shards) against what a user writes without it (build the whole model, then
fully_shard it: torch's FSDP2 tutorial).

    python scripts/bench_setup_memory.py                       # transformer dim 1024, 8 layers, mesh 2

Each side runs in fresh gloo ranks (started by torch's elastic agent), so each rank's peak
resident set (ru_maxrss, which never goes down) covers that side's set-up alone: the figure
is the peak after set-up minus the resident set before it (torch imported, process group up).
"""

from __future__ import annotations

import argparse
import math
import resource
import tempfile
from pathlib import Path
from typing import Any


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def composerun_side(cfg: Any, root: str) -> dict[str, float]:
    import gc

    from composerun.parallel.mesh import init_mesh, teardown
    from composerun.train.setup import set_up

    mesh, device = init_mesh(cfg.mesh)
    gc.collect()
    before = _rss_mib()
    s = set_up(cfg, Path(root), mesh, device)
    held = sum(p.to_local().numel() * 4 for p in s.model.parameters()) / 2**20
    out = {"setup_mib": _rss_mib() - before, "shard_mib": held}
    s.ckpt.close()
    teardown()
    return out


def handwritten_side(cfg: Any, root: str) -> dict[str, float]:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from composerun.models.transformer import Transformer

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gc.collect()
    before = _rss_mib()
    torch.manual_seed(0)
    m = cfg.model
    model = Transformer(vocab_size=m.vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.optim.AdamW(model.parameters())
    held = sum(p.to_local().numel() * 4 for p in model.parameters()) / 2**20
    out = {"setup_mib": _rss_mib() - before, "shard_mib": held}
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mesh", default="2")
    args = ap.parse_args()
    from hydra import compose, initialize_config_module

    from composerun.cli import quote_mesh_choices
    from composerun.config import register, to_typed, validate
    from composerun.config.schema import LaunchConfig, StartMethod
    from composerun.launch.agent import start_ranks

    register()
    ov = ["+model=transformer", f"model.dim={args.dim}", f"model.n_layers={args.layers}", "model.n_heads=8"]
    ov += [f"mesh={args.mesh}", "sharding=fsdp_blocks", "checkpoint=none", "metrics.progress=false"]
    with initialize_config_module(config_module="composerun.configs", version_base="1.3"):
        node = compose("train", overrides=quote_mesh_choices(ov))
    validate(node)
    cfg = to_typed(node)
    world = math.prod(cfg.mesh.shape)
    lcfg = LaunchConfig(start_method=StartMethod.spawn)
    whole = sum(p.numel() for p in _meta_model(cfg).parameters()) * 4 / 2**20
    print(f"transformer dim {args.dim}, {args.layers} layers ({whole:.0f} MiB of fp32 parameters), mesh {args.mesh}")
    for name, fn in (("handwritten: build whole, then fully_shard", handwritten_side), ("composerun", composerun_side)):
        with tempfile.TemporaryDirectory() as tmp:
            ranks = start_ranks(fn, (cfg, tmp), world, Path(tmp), lcfg)
        for r in range(world):
            f = ranks[r]
            print(f"{name:<45} rank {r}: set-up peak +{f['setup_mib']:.0f} MiB (its shards: {f['shard_mib']:.0f} MiB)")


def _meta_model(cfg: Any) -> Any:
    from composerun.models.init import build_on_meta

    return build_on_meta(cfg.model)


if __name__ == "__main__":
    main()
