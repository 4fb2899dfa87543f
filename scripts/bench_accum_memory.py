"""Gradient memory per rank under gradient accumulation: what each rank really holds between
micro-batches, against the sharded figure and the plan.

    python scripts/bench_accum_memory.py                       # composite dim 256, mesh 2, grad_accum 4
    python scripts/bench_accum_memory.py --dim 16 --json OUT   # (tests/test_scale.py)

Each case is a real composerun run (`sharding=fsdp`) on gloo ranks started by torch's elastic
agent; before each micro-batch's forward, every rank counts the gradient elements it holds
(its gradients' local shards, and the whole gradients FSDP keeps while a reduce-scatter is
deferred: composerun/_torch_compat.py `held_gradient_elements`).  The most it held between
two micro-batches of a step is set beside the elements of its parameter shards (the sharded
figure), the whole model's, and the plan's gradient bytes for the rank.

Cases: the default (reduce-scatter every micro-batch, shards accumulated) and
`sharding.accumulate_unsharded=true` (whole gradients kept until the last micro-batch).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

CASES = {"default": [], "accumulate_unsharded": ["sharding.accumulate_unsharded=true"]}


def held_between_micro_batches(jobs: list[tuple[str, Any]], root: str) -> dict[str, dict[str, int]]:
    """On every rank: train each job, recording the gradient elements held before each
    micro-batch; {name: {held, shard, whole}} for this rank."""
    import torch.distributed as dist

    from composerun import _torch_compat as compat
    from composerun.parallel.apply import MicroBatchSwitches
    from composerun.parallel.mesh import init_mesh, teardown
    from composerun.rundir import RunDir
    from composerun.train.run import train

    seen: list[int] = []
    original = MicroBatchSwitches.set

    def counting(self: Any, last: bool) -> None:  # (FSDP's switches, set before each micro-batch)
        seen.append(compat.held_gradient_elements(self.model))
        original(self, last)

    MicroBatchSwitches.set = counting
    mesh, device = init_mesh(jobs[0][1].mesh)
    out = {}
    for name, cfg in jobs:
        seen.clear()
        train(cfg, Path(root) / name, mesh, device)
        plan = json.loads(RunDir(Path(root) / name).plan.read_text())
        out[name] = {
            "held": max(seen),
            "shard": sum(u["bytes_per_rank"]["params"][dist.get_rank()] for u in plan["units"]) // 4,
            "plan_grads": plan["bytes_per_rank"]["grads"][dist.get_rank()] // 4,
            "whole": sum(math.prod(p["shape"]) for u in plan["units"] for p in u["params"]),
        }
    teardown()
    return out


def measure(
    dim: int, mesh: str, accum: int, steps: int, root: Path, start_method: str = "spawn"
) -> dict[str, list[dict[str, int]]]:
    """{case: one {held, shard, plan_grads, whole} per rank} (element counts, fp32).  The ranks
    are spawned (a fresh interpreter each); a caller that keeps a fork server with composerun
    imported (the tests) passes start_method="forkserver"."""
    from hydra import compose, initialize_config_module

    from composerun.cli import quote_mesh_choices
    from composerun.config import register, to_typed, validate
    from composerun.config.schema import LaunchConfig, StartMethod
    from composerun.launch.agent import start_ranks

    register()
    jobs = []
    world = math.prod(int(n) for n in mesh.split("x"))
    for name, extra in CASES.items():
        ov = ["+model=composite", f"model.dim={dim}", f"mesh={mesh}", "sharding=fsdp", f"train.grad_accum={accum}"]
        ov += [f"train.steps={steps}", f"data.batch_size={accum * 2 * world}", "checkpoint=none"]
        ov += ["metrics.progress=false", *extra]
        with initialize_config_module(config_module="composerun.configs", version_base="1.3"):
            node = compose("train", overrides=quote_mesh_choices(ov))
        validate(node)
        jobs.append((name, to_typed(node)))
    lcfg = LaunchConfig(start_method=StartMethod(start_method))
    per_rank = start_ranks(held_between_micro_batches, (jobs, str(root)), world, root, lcfg)
    return {name: [per_rank[r][name] for r in range(world)] for name in CASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--mesh", default="2")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.dim, args.mesh, args.accum, args.steps, Path(tmp))
    print(f"composite dim {args.dim}, mesh {args.mesh}, grad_accum {args.accum}, fsdp (fp32 elements per rank)")
    print(
        f"{'case':<22} {'rank':>4} {'held between micro-batches':>27} {'own shard':>10} {'plan grads':>11} {'whole model':>12}"
    )
    for name, ranks in result.items():
        for r, f in enumerate(ranks):
            print(f"{name:<22} {r:>4} {f['held']:>27,} {f['shard']:>10,} {f['plan_grads']:>11,} {f['whole']:>12,}")
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
