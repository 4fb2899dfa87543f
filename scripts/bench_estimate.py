"""plan=true's estimated peak memory per rank against the peak a real run measures, on CPU.

    python scripts/bench_estimate.py [--mesh 2x2] [--only transformer,llama3_debug] [--json OUT]

For every reference model, the transformer and the Llama (debug, small) under fsdp, hsdp and
fsdp_ac (the per-block policies and tensor parallelism where the model has blocks), this runs
the real thing (`composerun ... train.steps=3` on gloo ranks: summary.json's
measured_peak_bytes_per_rank, the peak of step 2 on every rank by torch's memory tracker) and
the plan (`plan_offline`: one step on fake tensors on the fake process group), and prints
the table BENCHMARKS.md holds: each case's largest measured and estimated peak, and the worst
relative difference over the ranks.  The suite checks every case within 10 % (the policy
matrix, tests/test_policies.py; the TP cells, tests/test_throughput_rules.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composerun.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

MODELS = {  # the policy matrix's sizes (tests/test_policies.py)
    "unit": ["model.dim=16"],
    "composite": ["model.dim=16"],
    "unit_param": ["model.dim=16"],
    "composite_param": ["model.dim=16"],
    "nested_sequential": ["data.batch_size=64"],
    "fusion_embedding": [],
    "fusion_embedding_with_hook": [],
    "fusion_embedding_with_modifier": [],
    "transformer": ["model.dim=32", "model.n_layers=2", "model.seq_len=8"],
    "llama3_debug": ["model.dim=32", "model.n_layers=2", "model.seq_len=8", "model.kwargs.ffn_dim=64"],
}
BLOCKS = ("transformer", "llama3_debug")


def cases(mesh: str) -> list[tuple[str, list[str]]]:
    out = []
    for model, extra in MODELS.items():
        policies = ["fsdp", "hsdp", "fsdp_ac"] + (["fsdp_blocks_ac", "fsdp_tp"] if model in BLOCKS else [])
        for policy in policies:
            out.append((f"{model} {policy}", [f"+model={model}", *extra, f"mesh={mesh}", f"sharding={policy}"]))
    return out


def measured(run_dir: Path, overrides: list[str]) -> list[int]:
    cmd = [str(Path(sys.executable).with_name("composerun")), *overrides, "train.steps=3", "metrics.progress=false"]
    r = subprocess.run([*cmd, f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])
    return (RunDir(run_dir).read_summary() or {})["measured_peak_bytes_per_rank"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--only", default="", help="comma-separated models")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from conftest import compose  # (the tests' compose: Hydra's API and composerun's checks)

    from composerun.parallel.planner import plan_offline

    only = set(filter(None, args.only.split(",")))
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, ov in cases(args.mesh):
            if only and name.split()[0] not in only:
                continue
            real = measured(Path(tmp) / name.replace(" ", "-"), ov)
            est = plan_offline(compose(*ov, "train.steps=3"))[0]["estimate"]["peak_bytes_per_rank"]
            worst = max(abs(e - m) / m for e, m in zip(est, real, strict=True))
            rows.append({"case": name, "measured": max(real), "estimated": max(est), "worst_rel_diff": worst})
            print(f"{name:45s} measured {max(real):>10,d} B  estimated {max(est):>10,d} B  worst rank {worst:6.2%}", flush=True)
    print(f"\n{len(rows)} cases on mesh {args.mesh} in {time.time() - t0:.0f} s; within 10 %: "
          f"{sum(r['worst_rel_diff'] <= 0.10 for r in rows)}; largest difference {max(r['worst_rel_diff'] for r in rows):.2%}")
    print("\n| case | measured peak (largest rank) | estimated | worst rank's difference |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['measured']:,} B | {r['estimated']:,} B | {r['worst_rel_diff']:.2%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
