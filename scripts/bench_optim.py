"""AdamW step time on CPU: torch's default implementation against foreach and fused, in one
invocation (the ratio behind composerun/configs/optim/adamw.yaml's `fused: true`).

    python scripts/bench_optim.py            # 4 square fp32 matrices per width, 1 thread

Each figure is the median of --repeats timed steps after one untimed step (which creates the
state); the ratios are against the default implementation measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def step_time(dim: int, repeats: int, **kwargs: bool) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(dim, dim)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, **kwargs)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[100, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); AdamW step, 4 x dim^2 fp32 parameters")
    print("| dim | default | foreach | fused | fused / default |")
    print("|---|---|---|---|---|")
    for dim in args.dims:
        base = step_time(dim, args.repeats)
        each = step_time(dim, args.repeats, foreach=True)
        fused = step_time(dim, args.repeats, fused=True)
        print(f"| {dim} | {base * 1e3:.2f} ms | {each * 1e3:.2f} ms | {fused * 1e3:.2f} ms | {fused / base:.3f} |")


if __name__ == "__main__":
    main()
