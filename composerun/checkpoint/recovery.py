"""Recovering a save that every rank had written when the run stopped before publishing it.

A save is published at a step boundary after every rank has written its files (an async
save's at the first boundary after its write ends).  A run killed or failed in between
leaves a tmp folder `step-N.tmp-<id>` holding a complete checkpoint but no manifest.  So
each rank, once its files are written and fsync'd, leaves its share of the manifest there
(`manifest.rank<R>.json`: its files' sizes and checksums, computed as it wrote them; rank
0's also the manifest's fields), and start-up publishes the newest such folder whose every
rank's share is there, with exactly the files they list, of the sizes and checksums they
record.  Any other tmp folder (a save cut short, a file damaged since) is removed, never
resumed from.  This runs once, before any rank starts, as part of choosing where the run
starts (checkpoint/start.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from composerun.checkpoint.folders import SHARE, is_complete, publish, step_dir_name, step_folders
from composerun.checkpoint.manifest import MANIFEST, _algorithm, check_checksums
from composerun.errors import CheckpointError

# A save's tmp folder: `step-N.tmp-` and 8 hex digits (the leftovers of publishing and
# pruning are named otherwise, and never recovered).
SAVE_TMP = re.compile(r"^step-(\d{8,})\.tmp-[0-9a-f]{8}$")


def recover(root: Path) -> tuple[Path | None, list[str]]:
    """Before any rank starts (checkpoint/start.py, in the one process that holds the run
    directory's lock): publish the newest save that every rank had written and recorded, once
    the checksums of all its files are checked; then remove every other leftover of
    unfinished saves.  The step folder published (or None), and a line for each thing done
    (rank 0 logs them)."""
    published, notes = None, []
    found = candidate(root, notes)
    if found is not None:
        tmp, meta, files = Path(found[0]), found[1], found[2]
        bad = check_checksums(tmp, {"files": files}, sorted(files))
        if bad:
            notes.append(f"removed what the stopped run left unfinished: {bad}")
        else:
            published = root / step_dir_name(meta["step"])
            publish(root, tmp, published, meta, files)
            notes.append(f"recovered {published}: the run stopped after every rank wrote it, before it was published")
    remove_leftovers(root)
    return published, notes


def candidate(root: Path, notes: list[str] | None = None) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """(tmp folder, manifest fields, files) of the newest unpublished save whose every file
    is recorded; None if there is none.  `notes`: a line added for each passed over."""
    for tmp in unpublished(root):
        try:
            return (str(tmp), *recoverable(tmp))
        except (CheckpointError, OSError) as e:  # removed by remove_leftovers, after the recovery
            if notes is not None:
                notes.append(f"removed what the stopped run left unfinished: {e}")
    return None


def write_share(tmp: Path, rank: int, record: dict[str, Any]) -> None:
    """A rank's share of the manifest (its files' sizes and checksums, and rank 0's the
    manifest's fields), written and fsync'd into the tmp folder once the rank's files are."""
    path = tmp / f"manifest.rank{rank}.json"
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        part.replace(path)
    except BaseException:
        part.unlink(missing_ok=True)  # (a full disk: no half-written file left behind)
        raise


def unpublished(root: Path) -> list[Path]:
    """Tmp folders of saves newer than the newest published checkpoint, the newest first:
    what a run that stopped before publishing them may have finished writing."""
    if not root.is_dir():
        return []
    done = [step for step, p in step_folders(root) if is_complete(p)]
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := SAVE_TMP.match(p.name)) and p.is_dir()]
    return [p for step, p in sorted(found, reverse=True) if step > max(done, default=-1)]


def recoverable(tmp: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the manifest's fields, its files) of a tmp folder every rank finished writing: each
    rank's share there, of the same step and world size, DCP's `.metadata`, and every file
    the shares list there with its size and nothing else.  The checksums are the caller's to
    check.  CheckpointError says what is missing."""
    step = int(SAVE_TMP.match(tmp.name).group(1))
    shares: dict[int, dict[str, Any]] = {}
    for p in tmp.iterdir():
        if m := SHARE.match(p.name):
            try:
                shares[int(m.group(1))] = json.loads(p.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{p}: unreadable ({e.__class__.__name__})") from None
    world = shares.get(0, {}).get("world_size")
    if not isinstance(world, int) or sorted(shares) != list(range(world)):
        done = ("rank " if len(shares) == 1 else "ranks ") + ", ".join(map(str, sorted(shares)))
        done = (done + (f" of {world}" if isinstance(world, int) else "")) if shares else "no rank"
        raise CheckpointError(f"{tmp}: a save of step {step} cut short ({done} had finished writing its files)")
    meta, files = shares[0].get("meta"), {}
    for rank, share in sorted(shares.items()):
        if (share.get("step"), share.get("world_size"), share.get("rank")) != (step, world, rank):
            raise CheckpointError(f"{tmp}: rank {rank}'s record is of another save")
        for name, entry in share.get("files", {}).items():
            if name in files or not (isinstance(entry, dict) and "bytes" in entry and _algorithm(entry)):
                raise CheckpointError(f"{tmp}: rank {rank}'s record of {name} is not valid")
            files[name] = entry
    if not isinstance(meta, dict) or (meta.get("step"), meta.get("world_size")) != (step, world):
        raise CheckpointError(f"{tmp}: rank 0's record has no manifest fields of this save")
    if ".metadata" not in files:
        raise CheckpointError(f"{tmp}: DCP's .metadata is not recorded: the save did not finish")
    # a manifest being written when the run stopped is written again
    present = {p.name for p in tmp.iterdir() if not SHARE.match(p.name) and p.name not in (MANIFEST, MANIFEST + ".tmp")}
    missing, extra = sorted(set(files) - present), sorted(present - set(files))
    if missing or extra:
        raise CheckpointError(f"{tmp}: not completely written (missing {missing}, not recorded {extra})")
    for name, entry in files.items():
        if (tmp / name).stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{tmp / name}: {(tmp / name).stat().st_size} bytes, recorded {entry['bytes']}")
    return meta, files


def remove_leftovers(root: Path) -> None:
    """Rank 0, at start-up: what unfinished saves, publishing and pruning left (tmp folders, a
    `latest` never swapped in)."""
    for stale in root.glob("*.tmp-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
