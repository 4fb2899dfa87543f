"""DCP checkpoints under <run>/checkpoints/step-NNNNNNNN/, published atomically.

A checkpoint is a flat dict of Stateful objects under fixed keys: `model` (FQN-keyed like
the unsharded model's state_dict()), `optim` (FQN-keyed), `train` (step and samples seen).
It is plain DCP: torch alone can load its `model` entry into the reference model.

Publishing (PITFALLS §3.6): every rank writes into a fresh `step-N.tmp-<id>` folder
(overwrite=False), all ranks confirm, rank 0 renames it to `step-N` and then replaces
`checkpoints/latest`.  A crash at any point leaves `latest` on the previous complete
checkpoint; leftover tmp folders are never resumed from and are removed at start-up.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from composerun.errors import CheckpointError

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd)


class OptimState(Stateful):
    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, sd)


class TrainState(Stateful):
    """Step and samples consumed, as tensors so that nothing here is pickled."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.samples)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples = int(sd["step"]), int(sd["samples"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_call(what: str, fn, *args, **kwargs):
    # CheckpointException is a BaseException: re-raise as an ordinary error (PITFALLS §3.6)
    try:
        return fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(
            f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint: `latest` if it names one, else the newest step-N with .metadata."""
    pointer = root / LATEST
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / ".metadata").is_file():
            return cand
    done = sorted(p for p in root.glob("step-*") if ".tmp-" not in p.name and (p / ".metadata").is_file())
    return done[-1] if done else None


class Checkpointer:
    def __init__(self, run_dir: Path, ccfg: Any, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.root = run_dir / "checkpoints"
        self.cfg = ccfg
        self.train = TrainState()
        self.state = {"model": ModelState(model), "optim": OptimState(model, optim), "train": self.train}
        self.rank = dist.get_rank()
        self.last_saved: Path | None = None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # -- resume ---------------------------------------------------------------------------
    def resume(self) -> Path | None:
        mode = self.cfg["resume"]
        if mode == "never":
            return None
        path = find_latest(self.root) if mode == "auto" else Path(mode)
        if path is None:
            return None
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint.resume={path}: not a complete DCP checkpoint (no .metadata)")
        _dcp_call(f"loading {path}", dcp.load, self.state, storage_reader=FileSystemReader(str(path)))
        return path

    # -- save -----------------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        every = self.cfg["every"]
        return (last and self.cfg["at_end"]) or (every > 0 and step % every == 0)

    def save(self, step: int) -> Path:
        final = self.root / step_dir_name(step)
        token = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        tmp = self.root / f"{final.name}.tmp-{token[0]}"
        _dcp_call(f"saving {final}", dcp.save, self.state, storage_writer=FileSystemWriter(str(tmp), overwrite=False))
        dist.barrier()  # every rank's files are written and fsync'd
        if self.rank == 0:
            self._publish(tmp, final)
        dist.barrier()
        self.last_saved = final
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():  # this step is already published (complete): keep it, drop the copy
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.rename(tmp, final)
        pointer_tmp = self.root / f"{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, self.root / LATEST)
        _fsync_dir(self.root)
        kept = sorted(p for p in self.root.glob("step-*") if ".tmp-" not in p.name)
        for old in kept[: -self.cfg["keep"]]:
            shutil.rmtree(old, ignore_errors=True)
