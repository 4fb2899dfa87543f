"""Do DataLoader worker processes help on this machine?  Step time of the same run with its
batches made in the step (data.prefetch=0), on the rank's prefetch thread (data.workers=0,
the CPU default) and in worker processes (data.workers=N), the modes alternated, each
repeated; the median of each run's median step time, and its wall time.

    python scripts/bench_loader.py [--repeats 3] [--steps 100] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROG = str(Path(sys.executable).with_name("composerun"))
CASES = {
    "transformer/text": ("+model=transformer", "data=text"),
    "llama3_debug/tokens seq 256": ("+model=llama3_debug", "data=tokens", "data.seq_len=256", "sharding=fsdp_blocks"),
}
MODES = {"in step": ("data.prefetch=0", "data.workers=0"), "thread": ("data.workers=0",)}


def run(args: list[str], where: Path) -> dict:
    out = subprocess.run([PROG, *args, f"hydra.run.dir={where}"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"composerun {' '.join(args)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return json.loads((where / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    modes = {**MODES, **{f"{w} workers": (f"data.workers={w}",) for w in a.workers}}
    base = [f"mesh={a.ranks}", f"train.steps={a.steps}", "checkpoint.at_end=false", "metrics.progress=false"]
    with tempfile.TemporaryDirectory() as tmp:
        for case, case_args in CASES.items():
            times: dict[str, list[float]] = {m: [] for m in modes}
            walls: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(a.repeats):
                for m, mode_args in modes.items():
                    s = run([*case_args, *base, *mode_args], Path(tmp) / f"{case.replace('/', '_')}-{m}-{r}")
                    times[m].append(s["median_step_s"] * 1e3)
                    walls[m].append(s["wall_s"])
            print(f"{case}, mesh={a.ranks}, {a.steps} steps, {a.repeats} runs each:")
            for m in modes:
                runs = ", ".join(f"{t:.1f}" for t in times[m])
                print(
                    f"  {m:10s} median step {statistics.median(times[m]):6.1f} ms ({runs}); "
                    f"wall {statistics.median(walls[m]):.2f} s"
                )


if __name__ == "__main__":
    main()
