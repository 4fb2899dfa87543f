"""What composerun's defaults cost per step, against what a user writes without composerun.

    python scripts/bench_defaults.py --out bench-defaults            # ~15 min on 2 cores
    python scripts/bench_defaults.py --smoke --out /tmp/smoke         # a check that it runs

The baseline is scripts/handwritten_fsdp.py in its minimal form (torch's default AdamW, no
clipping, no determinism, the loss all-reduced after the first and last steps only), started
by torchrun.  composerun runs with its defaults (`+model=composite model.dim=D mesh=M
sharding=fsdp`; `checkpoint=none`, so that no save is timed).  Runs alternate, the side that
goes first alternating between repeats; each figure is the median over the repeats of one
ratio per repeat (the median step after --warmup steps, each side).

Then the cost of each of composerun's default features on its own: the minimal script with
that one feature added, against the minimal script, alternating the same way (one cell,
--feature-cell): the loss all-reduced every step (train.log_every=1), clipping at 1.0
(optim.grad_clip), fused AdamW (composerun/configs/optim/adamw.yaml), torch's deterministic algorithms
without and with torch's filling of new memory (the fill was composerun's default until
train.deterministic became null: on for CPU without the fill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import composerun, handwritten, machine  # noqa: E402

FEATURES = {
    "loss all-reduce every step": ("--log-every=1",),
    "grad clipping at 1.0": ("--clip=1.0",),
    "fused AdamW": ("--fused",),
    "deterministic algorithms, no fill (CPU default now)": ("--deterministic=on",),
    "deterministic algorithms with torch's fill (the old default)": ("--deterministic=fill",),
}
FULL = {"cells": [(100, "2"), (100, "2x4"), (2048, "2"), (2048, "2x4")], "steps": {100: 200, 2048: 15}, "warmup": 5}
SMOKE = {"cells": [(16, "2")], "steps": {16: 4}, "warmup": 1}


def median_step(step_s: list[float], warmup: int) -> float:
    return statistics.median(step_s[warmup:])


def pair(first_is_a: bool, a, b):
    """Run a() and b() in the given order; (a's result, b's result)."""
    if first_is_a:
        ra = a()
        return ra, b()
    rb = b()
    return a(), rb


def bench_cell(dim: int, mesh: str, steps: int, warmup: int, repeats: int, work: Path) -> dict:
    ratios, cr, hw, first_equal = [], [], [], []
    for r in range(repeats):
        name = f"d{dim}_m{mesh}_r{r}"
        (_, s, rows), (_, h) = pair(
            r % 2 == 0,
            lambda name=name: composerun(work / f"cr_{name}", mesh, dim, steps, "checkpoint=none"),
            lambda name=name: handwritten(work / f"hw_{name}.json", mesh, dim, steps),
        )
        c, m = median_step([row["step_s"] for row in rows], warmup), median_step(h["step_s"], warmup)
        cr.append(c)
        hw.append(m)
        ratios.append(c / m)
        first_equal.append(rows[0]["loss"] == h["losses"]["1"])  # the same model, data and first batch
        print(f"bench_defaults: d{dim} m{mesh} r{r}: composerun {c:.4f} s, minimal {m:.4f} s, {c / m:.3f}", flush=True)
    return {
        "dim": dim,
        "mesh": mesh,
        "steps": steps,
        "warmup_excluded": warmup,
        "composerun_median_step_s": statistics.median(cr),
        "minimal_median_step_s": statistics.median(hw),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "same_first_loss": all(first_equal),
    }


def bench_features(dim: int, mesh: str, steps: int, warmup: int, repeats: int, work: Path) -> dict:
    out = {}
    for i, (feature, flags) in enumerate(FEATURES.items()):
        ratios = []
        for r in range(repeats):
            name = f"f{i}_d{dim}_m{mesh}_r{r}"
            (_, with_it), (_, without) = pair(
                r % 2 == 0,
                lambda name=name, flags=flags: handwritten(work / f"{name}_with.json", mesh, dim, steps, *flags),
                lambda name=name: handwritten(work / f"{name}_without.json", mesh, dim, steps),
            )
            ratios.append(median_step(with_it["step_s"], warmup) / median_step(without["step_s"], warmup))
            print(f"bench_defaults: {feature} r{r}: {ratios[-1]:.3f}", flush=True)
        out[feature] = {"flags": list(flags), "ratio": statistics.median(ratios), "ratios": ratios}
    return out


def markdown(result: dict, argv: list[str]) -> str:
    m = result["machine"]
    lines = [
        f"`python scripts/bench_defaults.py {' '.join(argv)}` on {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"torch {m.get('torch', '?')}; {result['repeats']} alternating repeats, medians of per-repeat ratios.",
        "",
        "| model.dim | mesh | composerun defaults, median step | minimal script | ratio (per repeat) |",
        "|---|---|---|---|---|",
    ]
    for c in result["cells"].values():
        lines.append(
            f"| {c['dim']} | {c['mesh']} | {c['composerun_median_step_s'] * 1e3:.1f} ms | "
            f"{c['minimal_median_step_s'] * 1e3:.1f} ms | {c['ratio']:.3f} ({', '.join(f'{x:.3f}' for x in c['ratios'])}) |"
        )
    f = result["features_cell"]
    if not result["features"]:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Each feature alone, the minimal script with it / without it (model.dim={f[0]}, mesh={f[1]}):",
        "",
        "| feature | ratio (per repeat) |",
        "|---|---|",
    ]
    for name, v in result["features"].items():
        lines.append(
            f"| {name} (`{' '.join(v['flags'])}`) | {v['ratio']:.3f} ({', '.join(f'{x:.3f}' for x in v['ratios'])}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-defaults")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--feature-cell", default="2048,2", help="model.dim,mesh of the per-feature rows")
    ap.add_argument("--no-features", action="store_true")
    ap.add_argument("--cells", default="", help="only these model.dim,mesh cells, ';'-separated (e.g. '100,2')")
    args = ap.parse_args()
    p = SMOKE if args.smoke else FULL
    repeats = 1 if args.smoke else args.repeats
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "repeats": repeats, "cells": {}, "features": {}}
    cells = [(int(c.split(",")[0]), c.split(",")[1]) for c in args.cells.split(";") if c] or p["cells"]
    for dim, mesh in cells:
        result["cells"][f"d{dim}_m{mesh}"] = bench_cell(dim, mesh, p["steps"][dim], p["warmup"], repeats, work)
    dim, mesh = p["cells"][0] if args.smoke else (int(args.feature_cell.split(",")[0]), args.feature_cell.split(",")[1])
    result["features_cell"] = [dim, mesh]
    if not args.no_features:
        result["features"] = bench_features(dim, mesh, p["steps"][dim], p["warmup"], repeats, work)
    (work / "defaults.json").write_text(json.dumps(result, indent=2))
    text = markdown(result, sys.argv[1:])
    (work / "defaults.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
