"""GPU benchmark: composerun's transformer on one GPU with fully_shard per block and bf16.

Runs `python -m composerun` as a user would (one rank, cuda+nccl), reads the run's
metrics.jsonl, and reports tokens/s and model FLOPs utilization (MFU) against the chip's
datasheet bf16 dense peak and against a bf16 matmul measured in the same invocation.

    python scripts/bench_gpu.py --out bench-gpu            # needs a CUDA GPU

FLOPs per token follow the usual accounting (PaLM, nanoGPT): 6 * N (N: parameters that take
part in matmuls: the blocks and the output head, not the embedding tables) plus
12 * layers * dim * seq_len for attention, causal masking not discounted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16 tensor-core peak (SXM datasheets)

CASES = {
    "fsdp_blocks, bf16": ["sharding=fsdp_blocks"],
    "fsdp_blocks_ac (every 2nd block), bf16": ["sharding=fsdp_blocks_ac"],
}


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def run_case(name: str, extra: list[str], args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / "".join(c if c.isalnum() else "_" for c in name)
    cmd = [
        sys.executable, "-m", "composerun", "+model=transformer", "mesh=1", "mesh.device=cuda",
        f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
        f"model.vocab_size={args.vocab}", f"model.seq_len={args.seq}", f"data.batch_size={args.batch}",
        f"train.steps={args.steps}", "optim.warmup_steps=0", "train.deterministic=false",
        "sharding.param_dtype=bfloat16", "sharding.reduce_dtype=float32",
        "checkpoint=none", "metrics.progress=false", f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_s"] for r in rows[args.warmup :]]
    step_s = statistics.median(steady)
    plan = json.loads((run_dir / "plan.json").read_text())
    n_params = sum(plan["bytes_per_rank"]["params"]) // 4  # fp32 master weights
    n_matmul = n_params - (args.vocab + args.seq) * args.dim  # minus tok_emb and pos_emb tables
    flops_per_token = 6 * n_matmul + 12 * args.layers * args.dim * args.seq
    tokens_per_s = args.batch * args.seq / step_s
    return {
        "case": name,
        "params": n_params,
        "median_step_s": step_s,
        "step_s_spread": [min(steady), max(steady)],
        "tokens_per_s": tokens_per_s,
        "model_tflops_per_s": flops_per_token * tokens_per_s / 1e12,
        "peak_mem_gib": max(r["peak_mem_bytes"] for r in rows) / 2**30,
        "wall_s": wall,
        "final_loss": rows[-1]["loss"],
        "command": " ".join(cmd[1:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-gpu"))
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    args = p.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    measured = matmul_peak()
    results = [run_case(name, extra, args, args.out) for name, extra in CASES.items()]
    for r in results:
        r["mfu_vs_datasheet"] = r["model_tflops_per_s"] * 1e12 / peak if peak else None
        r["mfu_vs_measured_matmul"] = r["model_tflops_per_s"] * 1e12 / measured
    report = {
        "gpu": gpu,
        "torch": torch.__version__,
        "datasheet_bf16_peak_tflops": peak / 1e12 if peak else None,
        "measured_bf16_matmul_tflops": measured / 1e12,
        "shape": {k: getattr(args, k) for k in ("dim", "layers", "heads", "vocab", "seq", "batch", "steps", "warmup")},
        "results": results,
    }
    (args.out / "bench_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{gpu}, torch {torch.__version__}; bf16 matmul measured {measured / 1e12:.0f} TFLOP/s")
    print(
        f"{'case':42} {'params':>8} {'step s':>7} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'MFU*':>6} {'mem GiB':>8}"
    )
    for r in results:
        mfu = f"{r['mfu_vs_datasheet']:.1%}" if r["mfu_vs_datasheet"] else "n/a"
        print(
            f"{r['case']:42} {r['params'] / 1e6:7.0f}M {r['median_step_s']:7.3f} {r['tokens_per_s']:10.0f} "
            f"{r['model_tflops_per_s']:8.1f} {mfu:>6} {r['mfu_vs_measured_matmul']:6.1%} {r['peak_mem_gib']:8.1f}"
        )
    print("MFU: against the datasheet peak; MFU*: against the matmul measured here")


if __name__ == "__main__":
    main()
