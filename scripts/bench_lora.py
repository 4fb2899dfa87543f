"""LoRA (`adapter=lora`) against full fine-tuning of the same pretrained model on this machine's
CPU: step time, each rank's memory (measured and planned) and the checkpoint's size.

    python scripts/bench_lora.py [--dim 256] [--layers 4] [--mesh 2] [--steps 12] [--warmup 4] [--repeats 2] [--json OUT]

A random LlamaForCausalLM (vocabulary 2048, the shipped tokens'; SwiGLU 3 x dim; untied) is
written by transformers' `save_pretrained`, then each repeat runs the two commands a user types,

    composerun +model=llama3 model.pretrained=DIR data=tokens mesh=M sharding=fsdp ...
    composerun +model=llama3 model.pretrained=DIR data=tokens mesh=M sharding=fsdp adapter=lora ...

in an order that alternates from one repeat to the next (drift on a shared machine hits both
alike), each checkpointing once, at its last step.  Per run: the median `step_s` after the
first `--warmup` steps; the bytes of parameters, gradients and optimizer state each rank
measured (summary.json) and those the plan gives (plan.json), and the peak each rank measured;
the checkpoint folder's size on disk.  The ratios (LoRA over full) are of the medians over the
repeats; step-time ratios are also taken within each repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composerun.rundir import RunDir

PROG = str(Path(sys.executable).with_name("composerun"))
BATCH, SEQ = 8, 64
MODES = ("full", "lora")


def write_directory(directory: Path, dim: int, layers: int) -> int:
    """A random LlamaForCausalLM of llama3_debug's proportions at `dim`; its parameter count."""
    import torch
    import transformers

    heads = max(1, dim // 32)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(mode: str, directory: Path, where: Path, a: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    cmd = [PROG, "+model=llama3", f"model.pretrained={directory}", "data=tokens", f"mesh={a.mesh}", "sharding=fsdp",
           *(["adapter=lora"] if mode == "lora" else []), f"model.seq_len={SEQ}", f"data.batch_size={BATCH}",
           f"train.steps={a.steps}", f"checkpoint.every={a.steps}", "train.log_every=1", "metrics.progress=false",
           "metrics.track_memory=true", f"launch.omp_threads={a.threads}", f"hydra.run.dir={where}"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    rd = RunDir(where)
    rows = [json.loads(line) for line in rd.metrics.read_text().splitlines()]
    steps = [r["step_s"] for r in rows if "step_s" in r]
    summary = rd.read_summary() or {}
    plan = json.loads((where / "plan.json").read_text())
    ckpts = sorted((where / "checkpoints").glob("step-*"))

    def per_rank(table: dict) -> list[int]:  # params + grads + optimizer state, each rank
        return [sum(v) for v in zip(*(table[k] for k in ("params", "grads", "optim")), strict=True)]

    return {
        "median_step_s": statistics.median(steps[a.warmup :]),
        "measured_bytes_per_rank": per_rank(summary["measured_bytes_per_rank"]),
        "planned_bytes_per_rank": per_rank(plan["bytes_per_rank"]),
        "frozen_bytes_per_rank": plan.get("frozen", {}).get("bytes_per_rank"),
        "measured_peak_bytes_per_rank": summary["measured_peak_bytes_per_rank"],
        "checkpoint_bytes": folder_bytes(ckpts[-1]),
        "final_loss": summary.get("final_loss"),
        "command_wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mesh", default="2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        n_params = write_directory(directory, a.dim, a.layers)
        repeats = []
        for i in range(a.repeats):
            order = MODES if i % 2 == 0 else MODES[::-1]
            repeats.append({m: run(m, directory, Path(tmp) / f"{m}-{i}", a) for m in order})

    def med(mode: str, key: str, rank_max: bool = False) -> float:
        values = [r[mode][key] for r in repeats]
        return statistics.median(max(v) if rank_max else v for v in values)

    ratios = {
        "step_time": med("lora", "median_step_s") / med("full", "median_step_s"),
        "step_time_per_repeat": [r["lora"]["median_step_s"] / r["full"]["median_step_s"] for r in repeats],
        "measured_bytes_per_rank": med("lora", "measured_bytes_per_rank", True)
        / med("full", "measured_bytes_per_rank", True),
        "planned_bytes_per_rank": med("lora", "planned_bytes_per_rank", True)
        / med("full", "planned_bytes_per_rank", True),
        "measured_peak_per_rank": med("lora", "measured_peak_bytes_per_rank", True)
        / med("full", "measured_peak_bytes_per_rank", True),
        "checkpoint_bytes": med("lora", "checkpoint_bytes") / med("full", "checkpoint_bytes"),
    }
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": __import__("torch").__version__,
        "args": {k: str(v) for k, v in vars(a).items()},
        "params": n_params,
        "repeats": repeats,
        "lora_over_full": ratios,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "repeats"}, indent=1))
    for mode in MODES:
        r = repeats[-1][mode]
        print(f"{mode}: step {med(mode, 'median_step_s'):.4f} s, params+grads+optim per rank measured "
              f"{max(r['measured_bytes_per_rank'])} / planned {max(r['planned_bytes_per_rank'])} B, peak "
              f"{max(r['measured_peak_bytes_per_rank'])} B, checkpoint {r['checkpoint_bytes']} B")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
