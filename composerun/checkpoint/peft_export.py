"""A PEFT adapter directory out of a LoRA run (`adapter=lora checkpoint.export=peft`, or
`composerun-ckpt export CKPT --format peft OUT`), which `peft.PeftModel.from_pretrained(base, OUT)`
loads onto the base model as it is.

The directory holds `adapter_config.json` (a LoRA config: rank, alpha, dropout, the adapted
modules by their full names) and `adapter_model.safetensors`, the adapters' A and B under PEFT's
names: `base_model.model.` + the module's name in the base model + `.lora_A.weight` (PEFT stores
no adapter name).  The base model's module names are Hugging Face's for composerun's Llama
(`model.` before `layers`: models/hf.py) and transformers' model's own for `+model=hf`; any other
model is its own base.  Only the adapters are written: they are gathered whole (they are small)
and rank 0 writes the directory as `OUT.tmp`, renamed to OUT once complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composerun.checkpoint.export import agree
from composerun.checkpoint.folders import replace_dir
from composerun.checkpoint.safetensors_io import write_file
from composerun.config.schema import Config, Task
from composerun.errors import ConfigError
from composerun.models.hf import LLAMA, hf_name
from composerun.models.lora import is_adapter_key

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
METADATA = {"format": "pt"}


def check_peft(cfg: Config, option: str = "checkpoint.export=") -> None:
    """ConfigError unless `cfg` trains LoRA adapters and nothing else (PEFT's LoRA directory
    holds the adapters; base parameters that trained too would be left out)."""
    if str(cfg.adapter.name) != "lora":
        raise ConfigError(f"{option}peft: the run has no adapter to export; it needs adapter=lora")
    if cfg.adapter.train:
        raise ConfigError(
            f"{option}peft: adapter.train={list(cfg.adapter.train)} trains base parameters too, which a PEFT "
            "LoRA directory does not hold; export safetensors, or train the adapters only"
        )


def peft_names(cfg: Config, model_keys: list[str]) -> dict[str, str]:
    """{composerun's adapter key: PEFT's name} for the adapter keys among a model's state-dict keys."""
    base_name = hf_name if cfg.model._target_ == LLAMA else str  # (a transformers model's own names, or any model's)
    return {k: PREFIX + base_name(k) for k in model_keys if is_adapter_key(k)}


def adapter_config(cfg: Config, peft: dict[str, str]) -> dict[str, Any]:
    """adapter_config.json: the run's LoRA settings, the adapted modules by their full names."""
    modules = sorted({n.removeprefix(PREFIX).rsplit(".", 2)[0] for n in peft.values()})
    a = cfg.adapter
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if cfg.model.task == Task.tokens else None,
        "base_model_name_or_path": cfg.model.pretrained,
        "r": a.rank,
        "lora_alpha": a.alpha,
        "lora_dropout": a.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft(out: Path, cfg: Config, tensors: dict[str, torch.Tensor], model_keys: list[str]) -> Path:
    """The directory at `out` from the adapters' whole tensors (composerun's keys)."""
    peft = peft_names(cfg, model_keys)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / CONFIG).write_text(json.dumps(adapter_config(cfg, peft), indent=2) + "\n")
        specs = {peft[k]: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
        by_name = {peft[k]: t for k, t in tensors.items()}
        write_file(tmp / WEIGHTS, specs, METADATA, lambda keys: {k: by_name[k].contiguous() for k in keys})
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_peft(model: torch.nn.Module, cfg: Config, out: Path) -> Path:
    """The (sharded) model's adapters as a PEFT directory at `out`: every rank gathers them, rank
    0 writes; every rank raises the same CheckpointError if rank 0 fails."""
    sd = model.state_dict(keep_vars=True)
    whole = {}
    for key, t in sd.items():
        if is_adapter_key(key):
            full = t.full_tensor() if isinstance(t, DTensor) else t  # (a collective: every rank, same order)
            whole[key] = full.detach().to("cpu", torch.float32)
    err = None
    if dist.get_rank() == 0:
        try:
            write_peft(out, cfg, whole, list(sd))
        except OSError as e:
            err = str(e)
    agree(err, f"exporting the adapters to {out}")
    return out


def replaceable(out: Path) -> bool:
    """Whether `out` may be replaced by an export: absent, empty, or an earlier PEFT export."""
    return not out.exists() or (
        out.is_dir() and all(p.is_file() and p.name in (CONFIG, WEIGHTS) for p in out.iterdir())
    )


def export_checkpoint(
    cfg: Config, specs: dict[str, Any], load: Any, out: Path, _max_shard: int | None = None
) -> list[str]:
    """The command line's export (as hf_export's): `specs` the checkpoint's model keys (dtype,
    shape), `load(keys)` their tensors, `cfg` the run's config from its manifest; notes (none)."""
    check_peft(cfg, option="--format ")
    keys = [k for k in specs if is_adapter_key(k)]
    write_peft(out, cfg, {k: t.to(torch.float32) for k, t in load(keys).items()}, list(specs))
    return []
