"""Each rank's memory while it loads a Hugging Face Llama directory (`model.pretrained`):
composerun's reader (each rank reads only the rows it holds) against reading the whole file
on every rank and keeping its shard (what a loader without slicing does).

    torchrun --standalone --nproc_per_node N scripts/bench_pretrained_memory.py [--dim 1024] [--layers 8]
        [--file-dtype bfloat16]

Rank 0 first saves a random Llama (vocab 8192, GQA 16/4 heads, SwiGLU 3 x dim, untied: 454 MB
fp32 at dim 1024, 8 layers) as a Hugging Face directory: config.json and one
model.safetensors (fp32, or --file-dtype: bf16 files are read into a buffer and cast).  Every rank then shards a model on the meta device (fully_shard per layer,
then the root), materializes its shards, and loads the directory into them.  Per rank:

- shard: the bytes of the model's tensors the rank holds (model bytes / N);
- read: the bytes the reader read (counted at `RowReader.pread`), and the largest single
  read; reads go straight into the shards when the file's dtype is the model's (here), else
  into a buffer of their size, copied and dropped before the next: at most one is held;
- anon peak: the largest rise of the rank's anonymous resident memory (RssAnon: tensors,
  whoever made them; sampled every millisecond and right after each read, while its rows are
  held) during the load, above what the rank held before (its shards, already made);
- hwm: the rise of the peak resident set (VmHWM, reset before the load), which also counts
  the file's pages safetensors maps to read the rows (page cache: shared, reclaimable, and
  with the kernel's read-ahead around each faulted page).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from composerun.checkpoint import hf_import
from composerun.checkpoint.export import row_runs
from composerun.models.hf import hf_config, hf_name
from composerun.models.llama import Llama

MB = 1e6
PEAK = [0]  # the largest RssAnon seen during the load being measured


def _sample() -> None:
    PEAK[0] = max(PEAK[0], _status("RssAnon"))


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) * 1024


def llama(args: argparse.Namespace) -> Llama:
    return Llama(
        vocab_size=8192, dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=4, ffn_dim=3 * args.dim,
        max_seq_len=256,
    )  # fmt: skip


def save_directory(args: argparse.Namespace, directory: Path) -> int:
    """A random Llama as a Hugging Face directory; its bytes."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = llama(args)
    sd = {hf_name(k): v.to(args.file_dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(model, str(args.file_dtype).removeprefix("torch."))))
    return sum(t.numel() * t.element_size() for t in sd.values())


def sharded(args: argparse.Namespace, mesh) -> torch.nn.Module:
    with torch.device("meta"):
        model = llama(args)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict().values():
            (t.to_local() if isinstance(t, DTensor) else t).zero_()
    return model


def whole_then_shard(model: torch.nn.Module, directory: Path) -> None:
    """A loader without slicing: the whole file read on every rank, each keeping its rows."""
    from safetensors.torch import load

    sd = load((directory / "model.safetensors").read_bytes())
    _sample()
    with torch.no_grad():
        for key, live in model.state_dict(keep_vars=True).items():
            local = live.to_local()
            runs = row_runs(live) or []
            at = 0
            for a, b in runs:
                local[at : at + b - a].copy_(sd[hf_name(key)][a:b])
                at += b - a
    del sd


def measured(fn, *args) -> dict[str, float]:
    """Memory of fn(*args) on this rank (MB): anon peak and hwm above the start, reads."""
    reads: list[int] = []
    real_read = hf_import.RowReader.pread

    def read(self, key, first_row, out):
        real_read(self, key, first_row, out)
        reads.append(out.numel() * out.element_size())
        _sample()  # while the rows read are held

    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    base_anon, base_rss = _status("RssAnon"), _status("VmRSS")
    PEAK[0], done = base_anon, threading.Event()

    def sample() -> None:
        while not done.is_set():
            _sample()
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    hf_import.RowReader.pread = read
    t0 = time.perf_counter()
    try:
        fn(*args)
    finally:
        hf_import.RowReader.pread = real_read
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    _sample()
    return {
        "s": seconds,
        "read": sum(reads) / MB,
        "largest_read": max(reads, default=0) / MB,
        "anon_peak": (PEAK[0] - base_anon) / MB,
        "hwm": (_status("VmHWM") - base_rss) / MB,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--file-dtype",
        type=lambda s: getattr(torch, s),
        default=torch.float32,
        help="the saved weights' dtype (the model is fp32)",
    )  # noqa: E501
    p.add_argument("--dir", type=Path, default=None, help="where the Hugging Face directory is saved (a temporary one)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    made = [None]
    if rank == 0:
        directory = args.dir or Path(tempfile.mkdtemp(prefix="pretrained_"))
        directory.mkdir(parents=True, exist_ok=True)
        made = [(str(directory), save_directory(args, directory))]
    dist.broadcast_object_list(made, src=0)
    directory, model_bytes = Path(made[0][0]), made[0][1]
    rows = {}
    for name, fn in (("composerun", hf_import.load_pretrained), ("whole file", whole_then_shard)):
        model = sharded(args, mesh)
        shard = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values()) / MB
        rows[name] = {"shard": shard, **measured(fn, model, directory)}
        del model
    every: list = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        largest = max(t.numel() * t.element_size() for t in llama_shapes(args)) / MB
        print(
            f"model {model_bytes / MB:.0f} MB on {world} rank(s); model/N {model_bytes / MB / world:.0f} MB; largest tensor {largest:.1f} MB"
        )  # noqa: E501
        print(
            f"{'loader':<12}{'rank':>5}{'shard MB':>10}{'read MB':>9}{'largest read':>14}{'anon peak MB':>14}{'hwm MB':>8}{'s':>7}"
        )  # noqa: E501
        for name in rows:
            for r, row in enumerate(every):
                m = row[name]
                print(
                    f"{name:<12}{r:>5}{m['shard']:>10.1f}{m['read']:>9.1f}{m['largest_read']:>14.1f}{m['anon_peak']:>14.1f}{m['hwm']:>8.1f}{m['s']:>7.2f}"
                )  # noqa: E501
        if args.dir is None:
            shutil.rmtree(directory)
    dist.barrier()
    dist.destroy_process_group()


def llama_shapes(args: argparse.Namespace) -> list[torch.Tensor]:
    with torch.device("meta"):
        return list(llama(args).state_dict().values())


if __name__ == "__main__":
    main()
