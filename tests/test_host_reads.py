"""When the host reads the device: train.log_every's default, and the steps that read.

A read of a device value (`.item()`, `.tolist()`, `.cpu()`...) waits for every kernel queued
before it: on a GPU the host then cannot queue the next step's work (FSDP's all-gathers) while
this one runs.  The default logs every step on a CPU mesh and every 10th on GPUs, and a step
that does not log reads nothing (tested on one CPU rank: composerun's own reads are counted,
whatever the device)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compose, read_metrics

from composerun.errors import ConfigError
from composerun.train import trainer
from composerun.train.trainer import log_interval

STEPS = 23


def test_log_every_defaults_to_every_step_on_a_cpu_and_every_tenth_on_a_gpu() -> None:
    cfg = compose("+model=unit", "mesh.device=cuda")  # (composed only: no GPU needed)
    assert cfg.train.log_every is None
    assert log_interval(cfg.train.log_every, torch.device("cuda", 0)) == 10
    assert log_interval(cfg.train.log_every, torch.device("cpu")) == 1
    assert log_interval(compose("+model=unit", "train.log_every=3").train.log_every, torch.device("cuda")) == 3
    with pytest.raises(ConfigError, match=r"train\.log_every=0: must be at least 1"):
        compose("+model=unit", "train.log_every=0")


READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def test_a_step_that_does_not_log_reads_nothing_from_the_device(mesh, tmp_path: Path, monkeypatch) -> None:
    """Every read of a tensor's value that composerun's own code makes in the training loop,
    by step: only the steps it logs (the first, every 10th, the last) read."""
    from composerun.train.run import train

    at = {"step": 0}
    reads: dict[int, list[str]] = {}

    def counting(name: str, real: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if f"{Path('composerun')}/" in caller and "/tests/" not in caller:
                reads.setdefault(at["step"], []).append(f"{name} in {Path(caller).name}")
            return real(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    real_step = trainer.Trainer.step

    def step(self: trainer.Trainer, i: int) -> dict[str, Any]:
        at["step"] = i + 1  # what this step and the work after it (a save, an evaluation) read
        return real_step(self, i)

    monkeypatch.setattr(trainer.Trainer, "step", step)
    cfg = compose(
        "+model=composite", "model.dim=16", "sharding=fsdp", f"train.steps={STEPS}", "train.log_every=10",
        "checkpoint=none", "metrics.progress=false", "metrics.track_memory=false",
    )  # fmt: skip
    train(cfg, tmp_path / "run", mesh, torch.device("cpu"))
    logged = [r["step"] for r in read_metrics(tmp_path / "run")]
    assert logged == [1, 10, 20, STEPS]
    in_loop = {s: r for s, r in reads.items() if s > 0}  # (0: set-up, before the first step)
    assert sorted(in_loop) == logged, {s: r for s, r in in_loop.items() if s not in logged}
