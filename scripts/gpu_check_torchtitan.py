"""torchtitan beside composerun in scripts/gpu_check.py: its Llama 3 1B (the shape of composerun's
llama3_1b: 16 blocks, dim 2048, 32 heads / 8 KV heads, FFN 8192, vocabulary 128256, tied
embeddings; 3B and 8B for the presets of their shapes) on one GPU, at the same global batch, sequence length, steps and logging cadence as
composerun's runs, in torchtitan's own default recipe for one GPU: FSDP with bf16 parameters and
fp32 reduction, no activation checkpointing, no compile (the `eager` row's policy), its chunked
cross-entropy.

Two halves in one file:
- `item(check, shape)`, in gpu_check.py's process: installs the wheels carried in .whl/torchtitan/
  into a directory of their own (torchtitan's dependencies never shadow composerun's), writes the
  offline inputs (composerun's shipped tokenizer; a JSON-lines corpus of its shipped Shakespeare
  text, read as torchtitan's `c4_test` dataset from a local path) and runs the other half;
- `main()`, the run itself in a process of its own: torchtitan's Trainer built from its config
  classes, its `train_step` timed at the steps the host reads the device anyway (every
  `log_every` steps, where torchtitan logs), the allocator's peaks over the whole run.

No torchtitan code is kept in this repository: it is imported from the carried wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl" / "torchtitan"  # scripts/gpu_check_wheels.sh fills it
# composerun's preset -> torchtitan's llama3 flavour of the same shape (blocks, dims, heads, FFN, vocabulary, tying)
FLAVORS = {"llama3_1b": "1B", "llama3_3b": "3B", "llama3_8b": "8B"}


def item(check: Any, shape: Any) -> dict[str, Any]:
    """The torchtitan row of the check (gpu_check.Check, gpu_check_runs.Shape)."""
    from gpu_check_runs import outcome, run, skipped

    wheels = sorted(WHEELS.glob("*.whl"))
    flavor = FLAVORS.get(shape.model)
    eager = next((i for i in check.items if i.get("kind") == "run" and i["name"] == "eager"), {})
    seq = eager.get("tokens_per_sample") or 2048
    why_not = (
        "torchtitan trains on a CUDA GPU only (dry run on the CPU)" if check.dry
        else f"torchtitan has no flavour of {shape.model}'s shape here (only {', '.join(FLAVORS)})" if flavor is None
        else "its wheels were not carried (scripts/gpu_check_wheels.sh puts them in .whl/torchtitan/)" if not wheels
        else None
    )  # fmt: skip
    timeout = check.limit("torchtitan")
    if why_not or timeout is None:
        return skipped("torchtitan", "torchtitan", why_not or "budget spent")
    work = check.work / "torchtitan"
    shutil.rmtree(work, ignore_errors=True)
    site, data, result = work / "site", work / "data", work / "result.json"
    pip = [*check.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    installed = run(
        [*pip, "--target", str(site), *map(str, wheels)], work / "install.log", timeout, check.env, check.work
    )
    if installed["rc"] or installed["timed_out"]:
        return outcome("torchtitan", "torchtitan", installed, timeout, wheels=[w.name for w in wheels])
    write_corpus(data / "train.jsonl")
    env = {
        **check.env,
        # torchtitan's wheels first, then the image's packages; not composerun's directory
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO / "scripts")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(work / "hf"),
    }
    cmd = [
        *check.py, str(Path(__file__).resolve()), "--flavor", flavor, "--tokenizer", str(REPO / "composerun/assets/tokenizer"),
        "--data", str(data), "--batch", str(shape.batch), "--seq", str(seq), "--steps", str(shape.steps),
        "--log-every", str(shape.log_every), "--dump", str(work / "dump"), "--result", str(result),
    ]  # fmt: skip
    left = check.limit("torchtitan") or 1
    res = run(cmd, check.work / "logs" / "torchtitan.log", left, env, work)
    res["seconds"] = round(res["seconds"] + installed["seconds"], 1)
    got = outcome("torchtitan", "torchtitan", res, left, command=" ".join(cmd[2:]), wheels=[w.name for w in wheels])
    if got["status"] == "ok":
        got.update(json.loads(result.read_text()))
        # MFU with composerun's FLOPs per token for this shape and the same peak: one accounting for both rows
        fpt, peak = eager.get("flops_per_token"), eager.get("peak_flops")
        if fpt and peak and got.get("tokens_per_s"):
            got["mfu"] = fpt * got["tokens_per_s"] / peak
    got["name"] = f"torchtitan {flavor} (eager, FSDP)"
    return got


def write_corpus(path: Path, chars: int = 4000) -> None:
    """composerun's shipped Shakespeare text as JSON lines {"text": ...} of about `chars` each."""
    text = (REPO / "composerun/assets/shakespeare.txt").read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    docs, doc = [], []
    for para in re.split(r"\n\s*\n", text):
        doc.append(para)
        if sum(map(len, doc)) >= chars:
            docs.append("\n\n".join(doc))
            doc = []
    docs.append("\n\n".join(doc))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if d.strip()))


def build_config(args: argparse.Namespace) -> Any:
    """torchtitan's Trainer.Config for the run: its llama3 debug recipe's parts (llama3's
    config_registry) with the flavour's model, the check's shape and no activation checkpointing."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry(args.flavor)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path=args.tokenizer,
        dump_folder=args.dump,
        model_spec=spec,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, steps=args.steps),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=args.data),
        metrics=MetricsProcessor.Config(log_freq=args.log_every),
        activation_checkpoint=None,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description="torchtitan's Llama 3 on one GPU, timed (scripts/gpu_check.py)")
    for name in ("flavor", "tokenizer", "data", "dump", "result"):
        p.add_argument(f"--{name}", required=True)
    for name in ("batch", "seq", "steps", "log-every"):
        p.add_argument(f"--{name}", type=int, required=True)
    args = p.parse_args()
    t_start = time.perf_counter()  # the first step's time counts from here, set-up included, as composerun's
    # one rank, as torchrun would describe it
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist
    import torchtitan

    # torchtitan starts the allocator's peaks over at every log; the check wants the run's
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    trainer = build_config(args).build()
    marks: list[tuple[int, float]] = []  # (step, time) after the device finished it
    real_step = trainer.train_step

    def timed_step(*a: Any, **k: Any) -> Any:
        out = real_step(*a, **k)
        if trainer.step == 1 or trainer.step % args.log_every == 0:
            torch.cuda.synchronize()
            marks.append((trainer.step, time.perf_counter()))
        return out

    trainer.train_step = timed_step
    try:
        trainer.train()
    finally:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    # intervals (a, b] between two reads, after the first log_every steps: composerun's steady state
    pairs = zip(marks, marks[1:], strict=False)
    steady = [(t1 - t0_) / (b - a) for (a, t0_), (b, t1) in pairs if a >= args.log_every]
    step_s = statistics.median(steady) if steady else None
    result = {
        "torchtitan": getattr(torchtitan, "__version__", None),
        "torch": torch.__version__,
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s if step_s else None,
        "steady_steps": [args.log_every + 1, marks[-1][0]] if steady else None,
        "time_to_first_step_s": marks[0][1] - t_start if marks else None,
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
        "tokens_per_sample": args.seq,
    }
    Path(args.result).write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
