"""torch.compile per block, and full against selective activation checkpointing, on the Llama
debug model (`+model=llama3_debug data=tokens`), on this machine's CPU.

    python scripts/bench_compile_ac.py [--steps 30] [--repeats 3] [--meshes 1 2] [--json OUT]

1. Throughput.  Each repeat runs, in an order rotated from one repeat to the next (drift on a
   shared machine hits every case alike), a hand-written PyTorch loop (what a user writes
   without composerun: the same Llama class and dimensions, torch's default AdamW, no
   clipping, random tokens, one process, eager) and composerun with `sharding=fsdp_blocks`
   (eager) and `sharding=fsdp_blocks_compile` on each mesh.  Every compiled run starts
   with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR, what a first run pays); on mesh 1
   a second compiled run reuses that cache (what later runs pay).  Step time: the median of
   the steps after the first `--warmup` (compilation happens in the first step); compile
   time: the first step minus that median.  Ratios are taken within a repeat, then the
   median over repeats.
2. Activation checkpointing (none / full / selective, every block) at batch 8, sequence 256.
   Memory, one fresh process per mode and repeat: the model with AC applied through
   composerun's own `checkpoint_forward` (selective: the default save list, matmuls and
   attention), one forward+backward under torch's MemTracker (peak bytes of live tensors,
   by kind), and the rise of the process's peak resident set (ru_maxrss) over what it held
   before its first forward; forward+backward time, median of `--ac-iters`.  Then
   composerun's own step time for the three modes (mesh 1, sharding=fsdp_blocks,
   fsdp_blocks_ac with every=1, fsdp_blocks_sac).

Every process runs `--threads` OpenMP threads (default 1: on a 2-core machine shared with other
work, 2 threads per process make step times swing by 10x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composerun.rundir import RunDir

PROG = str(Path(sys.executable).with_name("composerun"))
# composerun/configs/model/llama3_debug.yaml, written out as a user would
LLAMA_DEBUG = dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256)
BATCH, SEQ, AC_SEQ = 8, 64, 256
MODEL = ["+model=llama3_debug", "data=tokens"]
AC_POLICIES = {
    "none": ["sharding=fsdp_blocks"],
    "full": ["sharding=fsdp_blocks_ac", "sharding.rules.0.every=1"],
    "selective": ["sharding=fsdp_blocks_sac"],
}


# ---- the children: one fresh process each ----


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def handwritten(steps: int) -> dict:
    """The baseline: a plain training loop, timed per step up to the loss read."""
    import torch
    import torch.nn.functional as F

    from composerun.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(**LLAMA_DEBUG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = torch.randint(0, LLAMA_DEBUG["vocab_size"], (BATCH, SEQ + 1))
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "first_loss": losses[0]}


def ac_memory(mode: str, iters: int) -> dict:
    """One forward+backward of the model with AC on every block: MemTracker's peak, the rise
    of ru_maxrss, and the median time of `iters` more."""
    import torch
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    from composerun.models.llama import Llama
    from composerun.parallel.compile import checkpoint_forward, resolve_ops

    torch.manual_seed(0)
    model = Llama(**LLAMA_DEBUG)
    if mode != "none":
        ac = {"mode": mode, "save_ops": sorted(resolve_ops("bench", None))}
        for block in model.layers:
            checkpoint_forward(block, ac)
    x = torch.randint(0, LLAMA_DEBUG["vocab_size"], (BATCH, AC_SEQ + 1))

    def forward_backward() -> None:
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()

    before = _maxrss()
    forward_backward()  # the untracked first pass: the process's peak
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        forward_backward()
    peak = tracker.get_tracker_snapshot("peak")
    by_kind = {getattr(k, "name", str(k)): int(v) for dev in peak.values() for k, v in dev.items()}
    times = []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        forward_backward()
        times.append(time.perf_counter() - t0)
    return {"tracked_peak": by_kind, "maxrss_rise": _maxrss() - before, "fwd_bwd_s": statistics.median(times)}


# ---- the parent ----


def child(args: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def composerun(args: list[str], where: Path, threads: int, cache: Path | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    cmd = [PROG, *args, f"launch.omp_threads={threads}", "checkpoint=none", "metrics.progress=false"]
    t0 = time.perf_counter()
    out = subprocess.run([*cmd, f"hydra.run.dir={where}"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"composerun {' '.join(args)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    run = RunDir(where)
    if "running eagerly" in run.rank_log(0).read_text():
        raise SystemExit(f"{where}: a compiled block fell back to eager; not a compile measurement")
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    summary = run.read_summary() or {}
    return {
        "step_s": [r["step_s"] for r in rows if "step_s" in r],
        "first_loss": summary["first_loss"],
        "final_loss": summary["final_loss"],
        "peak_mem_bytes": summary["peak_mem_bytes"],
        "command_wall_s": wall,
    }


def digest(run: dict, warmup: int, seq: int) -> dict:
    steady = statistics.median(run["step_s"][warmup:])
    first = run["step_s"][0]
    return {
        **run,
        "median_step_s": steady,
        "tokens_per_s": BATCH * seq / steady,
        "first_step_s": first,
        "first_minus_steady_s": first - steady,
    }


def throughput(a: argparse.Namespace, tmp: Path) -> dict:
    base = [*MODEL, f"train.steps={a.steps}"]
    units: list[tuple[str, ...]] = [("handwritten",)]
    for m in a.meshes:
        units += [
            (f"eager mesh {m}",),
            (f"compile mesh {m}", "compile mesh 1, warm cache") if m == "1" else (f"compile mesh {m}",),
        ]
    runs: dict[str, list[dict]] = {name: [] for unit in units for name in unit}
    for r in range(a.repeats):
        for unit in units[r % len(units) :] + units[: r % len(units)]:
            for name in unit:
                where = tmp / f"{name.replace(' ', '_').replace(',', '')}-{r}"
                if name == "handwritten":
                    res = child(["--handwritten", str(a.steps)], a.threads)
                else:
                    mesh = name.split()[2].rstrip(",")
                    policy = "fsdp_blocks_compile" if name.startswith("compile") else "fsdp_blocks"
                    cache = tmp / f"inductor-mesh{mesh}-{r}" if name.startswith("compile") else None
                    res = composerun([*base, f"mesh={mesh}", f"sharding={policy}"], where, a.threads, cache)
                runs[name].append(digest(res, a.warmup, SEQ))
                print(
                    f"  repeat {r}: {name:28s} median step {runs[name][-1]['median_step_s'] * 1e3:7.1f} ms, "
                    f"first step {runs[name][-1]['first_step_s']:.2f} s",
                    flush=True,
                )
    return runs


def ac_modes(a: argparse.Namespace, tmp: Path) -> dict:
    mem: dict[str, list[dict]] = {m: [] for m in AC_POLICIES}
    steps: dict[str, list[dict]] = {m: [] for m in AC_POLICIES}
    modes = list(AC_POLICIES)
    base = [*MODEL, "mesh=1", f"model.seq_len={AC_SEQ}", f"data.seq_len={AC_SEQ}", f"train.steps={a.ac_steps}"]
    for r in range(a.repeats):
        order = modes[r % 3 :] + modes[: r % 3]
        for m in order:
            mem[m].append(child(["--ac-memory", m, str(a.ac_iters)], a.threads))
        for m in order:
            res = composerun([*base, *AC_POLICIES[m]], tmp / f"ac-{m}-{r}", a.threads)
            steps[m].append(digest(res, a.warmup, AC_SEQ))
        print(
            f"  repeat {r}: "
            + ", ".join(
                f"{m} {mem[m][-1]['tracked_peak']['Total'] / 2**20:.1f} MiB / {steps[m][-1]['median_step_s'] * 1e3:.0f} ms"
                for m in modes
            ),
            flush=True,
        )
    return {"memory": mem, "composerun": steps}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def listed(xs: list[float], fmt: str = ".3f") -> str:
    return ", ".join(format(x, fmt) for x in xs)


def report(t: dict, ac: dict) -> None:
    """The two tables, in BENCHMARKS.md's form: medians over the repeats."""
    hw, n = t["handwritten"], len(t["handwritten"])
    print(
        "\n| case | median step | tokens/s | tokens/s vs hand-written (per repeat) "
        "| compile / eager, same mesh (per repeat) | first step - steady step (per repeat) | whole command |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs in t.items():
        vs_hw = [hw[i]["median_step_s"] / runs[i]["median_step_s"] for i in range(n)]
        vs_eager = ""
        if name.startswith("compile"):
            eager = t[f"eager mesh {name.split()[2].rstrip(',')}"]
            ratios = [eager[i]["median_step_s"] / runs[i]["median_step_s"] for i in range(n)]
            vs_eager = f"{med(ratios):.3f} ({listed(ratios)})"
        first = [x["first_minus_steady_s"] for x in runs]
        wall = f"{med([x['command_wall_s'] for x in runs]):.1f} s" if "command_wall_s" in runs[0] else ""
        cells = [name, ms(med([x["median_step_s"] for x in runs])), f"{med([x['tokens_per_s'] for x in runs]):,.0f}"]
        cells += [f"{med(vs_hw):.3f} ({listed(vs_hw)})", vs_eager, f"{med(first):.2f} s ({listed(first, '.2f')})", wall]
        print("| " + " | ".join(cells) + " |")
    mem, steps = ac["memory"], ac["composerun"]
    print(
        "\n| AC, every block | MemTracker peak (of it activations) | ru_maxrss rise | forward+backward "
        "| / none (per repeat) | composerun step | / none (per repeat) | composerun ru_maxrss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in AC_POLICIES:
        k = len(mem[m])
        fb = [mem[m][i]["fwd_bwd_s"] / mem["none"][i]["fwd_bwd_s"] for i in range(k)]
        st = [steps[m][i]["median_step_s"] / steps["none"][i]["median_step_s"] for i in range(k)]
        total = med([x["tracked_peak"]["Total"] for x in mem[m]]) / 2**20
        act = med([x["tracked_peak"]["ACT"] for x in mem[m]]) / 2**20
        cells = [m, f"{total:.1f} MiB ({act:.1f} MiB)", f"{med([x['maxrss_rise'] for x in mem[m]]) / 2**20:.0f} MiB"]
        cells += [ms(med([x["fwd_bwd_s"] for x in mem[m]])), f"{med(fb):.3f} ({listed(fb)})"]
        cells += [ms(med([x["median_step_s"] for x in steps[m]])), f"{med(st):.3f} ({listed(st)})"]
        cells += [f"{med([x['peak_mem_bytes'] for x in steps[m]]) / 2**20:.0f} MiB"]
        print("| " + " | ".join(cells) + " |")


def machine() -> dict:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per throughput run")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--meshes", nargs="+", default=["1", "2"])
    ap.add_argument("--ac-steps", type=int, default=15, help="training steps per composerun AC run")
    ap.add_argument("--ac-iters", type=int, default=5, help="timed forward+backward passes per AC process")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per process")
    ap.add_argument("--json", type=Path, help="write every raw figure here")
    ap.add_argument("--handwritten", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ac-memory", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.handwritten:
        print(json.dumps(handwritten(a.handwritten)))
        return
    if a.ac_memory:
        print(json.dumps(ac_memory(a.ac_memory[0], int(a.ac_memory[1]))))
        return
    info = {**machine(), "threads": a.threads, "load_start": os.getloadavg()}
    print(
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, Python {info['python']}, "
        f"{a.threads} thread(s) per process; load average {info['load_start'][0]:.2f}",
        flush=True,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"throughput: llama3_debug, batch {BATCH}, seq {SEQ}, {a.steps} steps, median after {a.warmup}")
        t = throughput(a, Path(tmp))
        print(f"activation checkpointing: batch {BATCH}, seq {AC_SEQ}")
        ac = ac_modes(a, Path(tmp))
    info.update(load_end=os.getloadavg(), duration_s=time.perf_counter() - t0)
    report(t, ac)
    print(f"\n{info['duration_s'] / 60:.1f} min; load average at the end {info['load_end'][0]:.2f}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {"machine": info, "args": {k: str(v) for k, v in vars(a).items()}, "throughput": t, "ac": ac}, indent=1
            )
        )


if __name__ == "__main__":
    main()
