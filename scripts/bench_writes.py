"""How a checkpoint save's bytes reach the disk: plain buffered writes (composerun's default)
against the page cache of bounded size (`checkpoint.bounded_cache=true`) and O_DIRECT
(`checkpoint.direct_io=true`), as save seconds.

    python scripts/bench_writes.py [--mib 768] [--repeats 5] [--ways plain,bounded] [--dir DIR]

One process saves a state of `--mib` MiB (float32 tensors of 64 MiB) with DCP through
composerun's writer (checksums while writing, no zip CRC-32s: the default), each way in
turn, the first way alternating between repeats, and prints each save's seconds, each way's
median and the median ratio of each way to the first.  Every save is fsync'd (DCP's
sync_files and the writer's close), so the seconds include the disk's.  The files go to
--dir (default: a folder beside this repository, on the disk checkpoints use) and are
removed after each save.  Only the machine it runs on is measured: a shared file system
(Lustre, GPFS, NFS) needs its own run there, with --dir on it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from composerun.checkpoint.writer import HashingFileSystem

WAYS = {"plain": {}, "bounded": {"bounded_cache": True}, "direct": {"direct": True}}


def save_seconds(sd: dict[str, torch.Tensor], root: Path, way: str = "plain", **options: bool) -> float:
    """One fsync'd DCP save of `sd` through composerun's file system, written `way` (plus any
    other HashingFileSystem options); its seconds.  (scripts/bench_crc.py uses it too.)"""
    path = root / f"save-{uuid.uuid4().hex[:8]}"
    writer = FileSystemWriter(str(path), overwrite=False)
    HashingFileSystem("xxh3_128", **WAYS[way], **options).install(writer)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=writer, no_dist=True)
    seconds = time.perf_counter() - t0
    shutil.rmtree(path)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ways", default="plain,bounded", help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1])
    args = p.parse_args()
    ways = args.ways.split(",")
    if not ways or any(w not in WAYS for w in ways):
        p.error(f"--ways={args.ways}: choose from {', '.join(WAYS)}")
    rows = (64 << 20) // 4 // 4096  # a 64 MiB float32 tensor of 4096 columns: 4096 rows
    sd = {f"t{i}": torch.randn(rows, 4096) for i in range(max(1, args.mib // 64))}
    root = Path(tempfile.mkdtemp(prefix=".bench-writes-", dir=args.dir))
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for way in ways:  # the first save of each way is not counted (new memory, cold paths)
            save_seconds(sd, root, way)
        for r in range(args.repeats):
            for way in ways if r % 2 == 0 else ways[::-1]:
                seconds[way].append(save_seconds(sd, root, way))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state: {len(sd) * 64} MiB in {len(sd)} tensors, {args.repeats} repeats, ways in turn: {', '.join(ways)}")
    for way in ways:
        s = seconds[way]
        print(f"{way:8s} s: {', '.join(f'{x:.3f}' for x in s)}  (median {statistics.median(s):.3f})")
    for way in ways[1:]:
        ratios = [a / b for a, b in zip(seconds[way], seconds[ways[0]], strict=True)]
        print(
            f"{way} / {ways[0]}: median {statistics.median(ratios):.2f} (per repeat: {', '.join(f'{x:.2f}' for x in ratios)})"
        )


if __name__ == "__main__":
    main()
