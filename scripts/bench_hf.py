"""Eager tokens/s of `+model=hf` (transformers' LlamaForCausalLM) against composerun's own
Llama (`+model=llama3`) of the same size, from the same directory, on this machine's CPU.

    python scripts/bench_hf.py [--steps 30] [--warmup 5] [--repeats 3] [--dim 128] [--layers 4] [--json OUT]

A LlamaForCausalLM of llama3_debug's shape (by default: dim 128, 4 blocks, 4 heads / 2 KV
heads, SwiGLU 384, vocabulary 2048, rope theta 500000, untied) with random weights is written
by transformers' `save_pretrained`; then each repeat runs the two commands a user types,

    composerun +model=llama3 model.pretrained=DIR data=tokens mesh=1 sharding=fsdp_blocks ...
    composerun +model=hf     model.pretrained=DIR data=tokens mesh=1 sharding=fsdp_blocks ...

in an order that alternates from one repeat to the next (drift on a shared machine hits both
alike).  Step time: the median `step_s` after the first `--warmup` steps; tokens/s: the global
batch's tokens over it.  The ratio (hf over llama3) is taken within a repeat; the summary gives
its median and its range over the repeats, and the final losses of every run (the two models
train the same weights on the same batches: they should end at the same loss).

Two commands a minute apart see different loads on a shared machine, so the script also
measures the pair in one process (`paired`): both models set up as those runs set them up
(composerun's set_up: mesh 1, fsdp_blocks, the directory's weights), then their training steps
(forward, cross-entropy, backward, AdamW) alternated one for one on the same random batch, so
that a change of load hits both alike; the ratio of their median step times, per repeat.

Every process runs `--threads` OpenMP threads (default 1: on a 2-core machine shared with other
work, 2 threads per process make step times swing).
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
MODELS = ("llama3", "hf")


def write_directory(directory: Path, dim: int, layers: int) -> int:
    """A random LlamaForCausalLM of llama3_debug's proportions at `dim`; its parameter count."""
    import torch
    import transformers

    heads = max(1, dim // 32)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=256,
        rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def run(model: str, directory: Path, where: Path, a: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    cmd = [PROG, *overrides(model, directory, a.steps), "train.log_every=1", "metrics.progress=false",
           "metrics.track_memory=false", f"launch.omp_threads={a.threads}", f"hydra.run.dir={where}"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    rows = [json.loads(line) for line in RunDir(where).metrics.read_text().splitlines()]
    steps = [r["step_s"] for r in rows if "step_s" in r]
    median = statistics.median(steps[a.warmup :])
    summary = RunDir(where).read_summary() or {}
    return {"step_s": steps, "median_step_s": median, "tokens_per_s": BATCH * SEQ / median,
            "final_loss": summary.get("final_loss"), "command_wall_s": wall}  # fmt: skip


def overrides(model: str, directory: Path, steps: int) -> list[str]:
    return [f"+model={model}", f"model.pretrained={directory}", "data=tokens", "mesh=1", "sharding=fsdp_blocks",
            f"train.steps={steps}", f"model.seq_len={SEQ}", f"data.batch_size={BATCH}", "checkpoint=none"]  # fmt: skip


def paired(directory: Path, where: Path, steps: int) -> dict[str, list[float]]:
    """(A child process.)  Both models set up as a one-rank run sets them up, their training
    steps alternated: {model: each step's seconds}."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_module

    from composerun.cli import quote_mesh_choices
    from composerun.config import to_typed
    from composerun.config import validate as validate_config
    from composerun.config.schema import Backend, Device, MeshConfig
    from composerun.models.hf import apply_pretrained
    from composerun.parallel.mesh import init_mesh, teardown
    from composerun.train.setup import set_up

    mesh, device = init_mesh(MeshConfig(shape=[1], device=Device.cpu, backend=Backend.gloo))
    setups = {}
    for model in MODELS:
        with initialize_config_module(config_module="composerun.configs", version_base="1.3"):
            node = compose("train", overrides=quote_mesh_choices(overrides(model, directory, steps)))
        apply_pretrained(node)
        validate_config(node)
        setups[model] = set_up(to_typed(node), where / model, mesh, device)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {m: [] for m in MODELS}
    for i in range(steps):
        for model in MODELS if i % 2 == 0 else MODELS[::-1]:
            setup = setups[model]
            t0 = time.perf_counter()
            loss = F.cross_entropy(setup.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            setup.optim.step()
            setup.optim.zero_grad(set_to_none=True)
            loss.item()
            times[model].append(time.perf_counter() - t0)
    teardown()
    return times


def paired_child(directory: Path, where: Path, a: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = str(a.threads)
    cmd = [sys.executable, __file__, "--paired", str(directory), str(where), "--steps", str(a.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"the paired run failed:\n{out.stderr[-3000:]}")
    times = json.loads(out.stdout.strip().splitlines()[-1])
    medians = {m: statistics.median(times[m][a.warmup :]) for m in MODELS}
    return {"step_s": times, "median_step_s": medians, "ratio": medians["llama3"] / medians["hf"]}


def machine() -> dict:
    import torch
    import transformers

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__}


def report(runs: dict[str, list[dict]], pairs: list[dict]) -> dict:
    ratios = [hf["tokens_per_s"] / ll["tokens_per_s"] for ll, hf in zip(runs["llama3"], runs["hf"], strict=True)]
    in_pairs = [p["ratio"] for p in pairs]
    print("\n| repeat | llama3 tokens/s | hf tokens/s | hf / llama3 | paired in one process: hf / llama3 |")
    print("|---|---|---|---|---|")
    for i, ratio in enumerate(ratios):
        ll, hf = runs["llama3"][i]["tokens_per_s"], runs["hf"][i]["tokens_per_s"]
        print(f"| {i + 1} | {ll:.0f} | {hf:.0f} | {ratio:.2f} | {in_pairs[i]:.2f} |")
    for what, r in (("the commands", ratios), ("paired in one process", in_pairs)):
        print(f"hf / llama3 tokens/s, {what}: median {statistics.median(r):.2f}, range {min(r):.2f}-{max(r):.2f} "
              f"over {len(r)} repeats")  # fmt: skip
    losses = {m: [r["final_loss"] for r in runs[m]] for m in MODELS}
    spread = max(x for v in losses.values() for x in v) - min(x for v in losses.values() for x in v)
    print(f"final losses: llama3 {losses['llama3']}, hf {losses['hf']} (largest difference {spread:.3g})")
    return {"ratios": ratios, "paired_ratios": in_pairs, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=128, help="hidden size (heads: dim/32, KV heads half, SwiGLU 3*dim)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per process")
    ap.add_argument("--json", type=Path, help="write every raw figure here")
    ap.add_argument("--paired", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.paired:
        print(json.dumps(paired(*a.paired, a.steps)))
        return
    info = {**machine(), "threads": a.threads, "load_start": os.getloadavg()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        n = write_directory(directory, a.dim, a.layers)
        print(f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, transformers {info['transformers']}, "
              f"{a.threads} thread(s); load average {info['load_start'][0]:.2f}; a Llama of {n / 1e6:.2f} M "
              f"parameters, batch {BATCH} x {SEQ} tokens, {a.steps} steps, median after {a.warmup}", flush=True)  # fmt: skip
        runs: dict[str, list[dict]] = {m: [] for m in MODELS}
        pairs = []
        for r in range(a.repeats):
            for model in MODELS if r % 2 == 0 else MODELS[::-1]:
                runs[model].append(run(model, directory, Path(tmp) / f"{model}-{r}", a))
                got = runs[model][-1]
                print(f"  repeat {r + 1}: {model:6s} median step {got['median_step_s'] * 1e3:7.1f} ms, "
                      f"{got['tokens_per_s']:6.0f} tokens/s", flush=True)  # fmt: skip
            pairs.append(paired_child(directory, Path(tmp) / f"paired-{r}", a))
            med = pairs[-1]["median_step_s"]
            print(f"  repeat {r + 1}: paired, median step llama3 {med['llama3'] * 1e3:.1f} ms, "
                  f"hf {med['hf'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    info.update(load_end=os.getloadavg(), duration_s=time.perf_counter() - t0)
    result = report(runs, pairs)
    print(f"{info['duration_s'] / 60:.1f} min; load average at the end {info['load_end'][0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(a).items()},
                                      "runs": runs, "paired": pairs, "result": result}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
