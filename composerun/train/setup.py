"""What a run sets up before its first step, on every rank: the model (one seeded
initialization, the same on every mesh), the policy applied to it, the optimizer over the
sharded parameters, the data, `init_from` or `model.pretrained`, and the checkpointer with its
resume of the checkpoint the launcher chose (checkpoint/start.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from composerun.checkpoint.adapters import base_identity
from composerun.checkpoint.checkpointer import Checkpointer
from composerun.checkpoint.export import init_from
from composerun.checkpoint.hf_import import load_pretrained
from composerun.checkpoint.start import Start
from composerun.config.schema import Config
from composerun.config.typed import to_plain
from composerun.data import build_data
from composerun.models import build_model
from composerun.models.init import build, materialize
from composerun.parallel.apply import apply_policy, tp_mesh
from composerun.parallel.mesh import DataParallel, data_parallel
from composerun.parallel.plan import build_report, format_table, write_plan
from composerun.parallel.rules import Unit
from composerun.parallel.tp_comm import trace_tp_comm
from composerun.rundir import RunDir
from composerun.train.metrics import reset_peak_memory
from composerun.train.optim import build_optimizer
from composerun.train.resume import resume

log = logging.getLogger("composerun")


@dataclass
class Setup:
    """A run ready for its first step."""

    cfg: Config
    run_dir: Path
    device: torch.device
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    data: Any
    ckpt: Checkpointer
    report: dict[str, Any]  # plan.json's content
    resumed: Path | None  # the checkpoint resumed from
    resume_s: float
    dp: DataParallel  # this rank's data-parallel replica: its samples, the loss mean
    units: dict[str, Unit]  # the policy's units, as applied (FQN -> APIs + options: rules.py)
    start: Start  # where the launcher decided the run starts (checkpoint/start.py)


def set_up(cfg: Config, run_dir: Path, mesh: DeviceMesh, device: torch.device, start: Start = Start()) -> Setup:
    run_dir.mkdir(parents=True, exist_ok=True)
    # Built on the meta device, sharded there, then only this rank's shards are made and
    # initialized: the same initial weights on every mesh (models/init.py).
    model, on_meta = build(cfg.model, cfg.train.seed, device, any(r.offload for r in cfg.sharding.rules), cfg.adapter)
    units = apply_policy(model, cfg.sharding, mesh, cfg.compile.fallback.value == "eager")
    if on_meta:
        materialize(model, device, cfg.train.seed, lambda: build_model(cfg.model, cfg.adapter, cfg.train.seed))
    optim = build_optimizer(model, cfg.optim)
    report = build_report(model, units, cfg, trace_tp_comm(cfg, tp_mesh(mesh)))
    data = build_data(cfg)
    if cfg.checkpoint.init_from:
        init_from(model, Path(cfg.checkpoint.init_from))
    ckpt = Checkpointer(run_dir, cfg.checkpoint, model, optim, manifest_meta(cfg, report))
    if dist.get_rank() == 0:
        for note in start.notes:  # what the launcher's recovery did (checkpoint/recovery.py)
            log.warning("%s", note)
    # an adapter run's checkpoints hold no base: it is read first (its forward checked before the adapters load)
    base_first = bool(cfg.model.pretrained and ckpt.state["model"].frozen)
    if base_first:
        load_pretrained(model, Path(cfg.model.pretrained), cfg.model.verify_pretrained)
    t0 = time.perf_counter()
    resumed = resume(ckpt, optim, cfg, start.load)  # with the config given, saying each change: train/resume.py
    resume_s = time.perf_counter() - t0
    if resumed is None and cfg.model.pretrained and not base_first:  # (only when no checkpoint's weights replace them)
        load_pretrained(model, Path(cfg.model.pretrained), cfg.model.verify_pretrained)
    step = ckpt.train.step
    if dist.get_rank() == 0:  # once the run is sure to go on: a failed resume leaves the earlier plan.json
        log.info("\n%s", format_table(report))
        if (cfg.train.steps or step) > step:  # it trains: plan.json is its plan (train.steps=0 keeps the run's)
            write_plan(RunDir(run_dir).plan, report)
    reset_peak_memory(device)  # peak_mem_bytes is training's peak, not set-up's
    dp = data_parallel(mesh)
    return Setup(cfg, run_dir, device, model, optim, data, ckpt, report, resumed, resume_s, dp, units, start)


def manifest_meta(cfg: Config, report: dict[str, Any]) -> dict[str, Any]:
    """What every checkpoint's manifest says about the run that wrote it."""
    plain = to_plain(cfg)

    def digest(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

    base = base_identity(cfg) if dist.get_rank() == 0 else None  # (rank 0 writes the manifest)
    return {
        **({"base": base} if base is not None else {}),  # what an adapter-only checkpoint applies to
        "model": report["model"],
        "model_hash": digest(plain["model"]),
        "config_hash": digest(plain),
        "config": plain,  # a resume with another config says what changed
        "mesh": report["mesh"],
        "policy": report["policy"],
        "plan": {u["fqn"]: u["apis"] for u in report["units"]},
    }
