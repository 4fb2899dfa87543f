"""Wall time and each rank's peak memory of a Hugging Face export (`checkpoint.export=hf`) of a
sharded Llama: composerun's (every rank writes its own rows into place) against what a user
writes without composerun (torch's full state dict gathered on rank 0's CPU, renamed, and
written there with safetensors' save_file, plus config.json).

    torchrun --standalone --nproc_per_node 2 scripts/bench_hf_export.py [--dim 1024 --layers 8]

The model is composerun's Llama (vocab 32000, dim/64 heads, half as many KV heads, ffn 4*dim)
under fully_shard per block and on the root, in fp32: 730 MiB at dim 1024 and 8 layers.
Memory is a rank's peak resident set (VmHWM, reset before each export) above what it held
before.  The baseline does not fsync its file; composerun's export does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import bench_export  # scripts/ is on the path of a script run from it
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from composerun.checkpoint.hf_export import export_hf
from composerun.config.schema import Config, ModelConfig
from composerun.models.hf import LLAMA, hf_config, hf_name
from composerun.models.llama import Llama


def measured(fn, *args) -> tuple[float, int]:
    """bench_export's measure of fn(*args) on this rank, until every rank is done."""
    return bench_export.measured(lambda: (fn(*args), dist.barrier()))


def sharded(kwargs: dict, mesh) -> torch.nn.Module:
    with torch.device("meta"):
        model = Llama(**kwargs)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(std=0.02)
    return model


def gather_export(model: torch.nn.Module, out: Path) -> None:
    """What a user writes: the full state dict on rank 0, saved there."""
    from safetensors.torch import save_file

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({hf_name(k): v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), {"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_config(model)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for the exports (default: a temporary one)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    box = [args.out or (tempfile.mkdtemp(prefix="bench_hf_export_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    out = Path(box[0])
    heads = args.dim // 64
    kwargs = dict(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=heads, n_kv_heads=heads // 2,
                  ffn_dim=4 * args.dim)  # fmt: skip
    cfg = Config(model=ModelConfig(_target_=LLAMA, kwargs=kwargs))
    model = sharded(kwargs, mesh)
    cases = {
        "rank 0 gathers": lambda: gather_export(model, out / "gathered"),
        "composerun": lambda: export_hf(model, cfg, out / "hf"),
    }
    rows = {name: [measured(fn) for _ in range(args.repeats)] for name, fn in cases.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        mib = sum(t.numel() * 4 for t in Llama(**kwargs).state_dict().values()) >> 20
        print(f"Llama dim {args.dim}, {args.layers} layers: {mib} MiB; {dist.get_world_size()} ranks")
        for name in cases:
            times = sorted(t for t, _ in every[0][name])
            peaks = " / ".join(f"r{r}: {max(m for _, m in e[name])} MiB" for r, e in enumerate(every))
            print(
                f"{name:<15} wall min {times[0]:.2f} s, median {statistics.median(times):.2f} s   peak above resident: {peaks}"
            )
    dist.barrier()
    if dist.get_rank() == 0 and not args.out:
        shutil.rmtree(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
