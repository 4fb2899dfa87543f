"""What torch.save's CRC-32s cost a checkpoint save (`checkpoint.zip_crc32`), as a ratio.

    python scripts/bench_crc.py [--mib 768] [--repeats 5] [--dir DIR]

One process saves a state of `--mib` MiB (float32 tensors of 64 MiB) with DCP through
composerun's writer (checksums while writing, plain buffered writes), with and without the
zip records' CRC-32s, alternating, and prints each save's seconds and the median ratio
(with / without).  The files go to --dir (default: a folder beside this repository, on
the disk checkpoints use) and are removed after each save.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from bench_writes import save_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1])
    args = p.parse_args()
    rows = (64 << 20) // 4 // 4096  # a 64 MiB float32 tensor of 4096 columns: 4096 rows
    sd = {f"t{i}": torch.randn(rows, 4096) for i in range(max(1, args.mib // 64))}
    root = Path(tempfile.mkdtemp(prefix=".bench-crc-", dir=args.dir))
    try:
        save_seconds(sd, root, crc32=False)  # the first save pays for new page-cache memory: not counted
        with_crc, without = [], []
        for _ in range(args.repeats):
            without.append(save_seconds(sd, root, crc32=False))
            with_crc.append(save_seconds(sd, root, crc32=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [a / b for a, b in zip(with_crc, without, strict=True)]
    print(f"state: {len(sd) * 64} MiB in {len(sd)} tensors, {args.repeats} alternating pairs")
    print("without CRC-32 s: " + ", ".join(f"{x:.3f}" for x in without))
    print("with CRC-32 s:    " + ", ".join(f"{x:.3f}" for x in with_crc))
    print(f"with / without: median {statistics.median(ratios):.2f} (per pair: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
