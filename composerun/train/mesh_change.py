"""The record of a run that resumed on another mesh than the checkpoint's (an elastic run that
lost a node or got one back, or a user's resume on another mesh): the first metrics row of the
run holds `mesh_change` (the step resumed, the old and new mesh and train.grad_accum, and the
seconds lost), and summary.json's `mesh_changes` lists every one the run's rows hold.

Seconds lost are counted from the moment the checkpoint resumed was published (its manifest's
modification time) to the end of the first step after the restart: the steps trained after
that checkpoint and thrown away, the failure's detection, the restart and the load."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from composerun.checkpoint.manifest import MANIFEST, read_manifest
from composerun.errors import CheckpointError

log = logging.getLogger("composerun")

LOST_FROM = "checkpoint published"  # what seconds_lost counts from


def mesh_change(resumed: Path | None, step: int, mesh: str, grad_accum: int) -> dict[str, Any] | None:
    """The change of this run against the checkpoint `resumed` at `step` (None: it resumed
    nothing, or on the same mesh); `since_unix` is when that checkpoint was published."""
    if resumed is None:
        return None
    try:
        manifest = read_manifest(resumed)
        published = (resumed / MANIFEST).stat().st_mtime
    except (CheckpointError, OSError):
        return None  # (the load read it: a checkpoint that went since is not this record's concern)
    before = manifest.get("mesh")
    if before is None or before == mesh:
        return None
    train = (manifest.get("config") or {}).get("train") or {}
    return {
        "step": step,
        "old_mesh": before,
        "new_mesh": mesh,
        "old_grad_accum": train.get("grad_accum"),
        "grad_accum": grad_accum,
        "old_world_size": manifest.get("world_size"),
        "since_unix": published,
    }


def first_row_field(change: dict[str, Any]) -> dict[str, Any]:
    """`mesh_change` of the first metrics row, at the end of the first step after the restart."""
    out = {k: v for k, v in change.items() if k != "since_unix"}
    out["seconds_lost"] = round(time.time() - change["since_unix"], 3)
    out["lost_from"] = LOST_FROM
    log.info(
        "composerun: resumed step %d on mesh %s (was %s), train.grad_accum %s (was %s): %.1f s lost since "
        "the checkpoint was published",
        *(out["step"], out["new_mesh"], out["old_mesh"], out["grad_accum"], out["old_grad_accum"], out["seconds_lost"]),
    )
    return out


def mesh_changes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """summary.json's `mesh_changes`: those the run's metrics rows hold, in step order."""
    return [r["mesh_change"] for r in rows if isinstance(r.get("mesh_change"), dict)]
