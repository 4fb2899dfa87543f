"""A run's checkpoints/ folder: its step folders, the `latest` symlink, finding the newest
complete checkpoint, publishing a save's tmp folder, and retention (which only ever
removes what composerun published, in a background thread)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from composerun.checkpoint.manifest import (
    MANIFEST,
    STEP_DIR,
    _fsync_dir,
    read_manifest,
    step_of,
    write_manifest,
)
from composerun.errors import CheckpointError
from composerun.rundir import RunDir

log = logging.getLogger("composerun")

LATEST = "latest"
# Each rank's share of the manifest, written into a save's tmp folder once its files are on
# the disk (recovery.py), removed once the manifest is.
SHARE = re.compile(r"^manifest\.rank(\d+)\.json$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every entry of `root` named like a published step folder (folders, symlinks, even broken
    ones or plain files: what a resume must not pass over), by step.  Anything else there
    (`step-notes.txt`, a tmp folder) is none of composerun's business."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return sorted(found)


def is_complete(path: Path) -> bool:
    """A folder (or a symlink to one) holding a manifest: what a save publishes."""
    return path.is_dir() and (path / MANIFEST).is_file()


def read_latest(root: Path) -> str | None:
    """The step folder `checkpoints/latest` names: a symlink (what composerun writes, so that
    `dcp.load(checkpoint_id=".../latest")` opens it), or a text file (older runs)."""
    pointer = root / LATEST
    try:
        if pointer.is_symlink():
            return Path(os.readlink(pointer)).name or None
        if pointer.is_file():
            return pointer.read_text().strip() or None
    except OSError:
        return None
    return None


def point_latest(root: Path, final: Path) -> None:
    """Make `latest` name `final`, atomically (a new link renamed over the old one); a text
    file where the file system has no symlinks."""
    tmp = root / f"{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.symlink(final.name, tmp, target_is_directory=True)
    except OSError:
        tmp.write_text(final.name + "\n")
    os.replace(tmp, root / LATEST)


def find_latest(root: Path, strict: bool = False) -> Path | None:
    """The newest complete checkpoint: the one `latest` names if it is complete, else the
    newest complete step folder.

    strict (a resume): a step folder newer than that one that is not a complete checkpoint
    (no manifest, a broken symlink, a file) is an error, not skipped.  A save only ever renames
    a complete folder into place, so such a folder was damaged after it was saved, and
    resuming from an older one would silently train its steps again."""
    name = read_latest(root)
    found = root / name if name and STEP_DIR.match(name) and is_complete(root / name) else None
    steps = step_folders(root)
    if found is None:
        done = [p for _, p in steps if is_complete(p)]
        found = done[-1] if done else None
    if strict:
        newest = step_of(found) if found is not None else -1
        damaged = [p for step, p in steps if step > newest and not is_complete(p)]
        if damaged:
            then = f"to resume from {found}, the newest complete one" if found else "to start over"
            what = "a broken symlink" if damaged[-1].is_symlink() and not damaged[-1].exists() else f"no {MANIFEST}"
            raise CheckpointError(
                f"{damaged[-1]}: {what}, not a complete checkpoint (damaged after its save); move it "
                f"out of {root} {then}, or start in a new hydra.run.dir"
            )
    return found


def resolve_resume(path: Path) -> Path:
    """What `checkpoint.resume=PATH` names: a checkpoint folder, or the newest complete
    checkpoint of a run directory or of its checkpoints/ folder."""
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    checkpoints = RunDir(path).checkpoints
    run_dir = checkpoints.is_dir()
    root = checkpoints if run_dir else path
    if not (run_dir or read_latest(root) is not None or step_folders(root)):
        return path  # not a run's checkpoints: the integrity check says what is missing
    found = find_latest(root, strict=True)
    if found is None:
        raise CheckpointError(
            f"checkpoint.resume={path}: no complete checkpoint in it; name one (checkpoints/step-N) "
            "or start over with checkpoint.resume=never"
        )
    return found


def _published_step(path: Path) -> int | None:
    """The step of a folder composerun published (a real folder, not a symlink, named like a
    step folder, whose manifest is readable and names that step), else None."""
    step = step_of(path)
    if step < 0 or path.is_symlink() or not path.is_dir():
        return None
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    return step if manifest.get("step") == step else None


def rotate(root: Path, keep: int, newest: Path) -> list[Path]:
    """Remove all but the `keep` newest checkpoints; returns what it removed.  Only folders
    composerun published count or go, never `newest` (the one just saved) nor the one
    `latest` names: a stray `step-notes.txt`, a symlink or a damaged folder is left alone.
    Each goes out of the way by a rename first, so that one half removed (the run killed
    meanwhile) is a leftover that start-up removes, not a damaged step folder."""
    named = read_latest(root)
    published = [(s, p) for _, p in step_folders(root) if (s := _published_step(p)) is not None]
    keep_set = {p.name for _, p in published[-keep:]} | {newest.name} | ({named} if named else set())
    removed = []
    for _, p in published:
        if p.name not in keep_set:
            gone = root / f"pruning-{p.name}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(p, gone)
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)
            removed.append(p)
    return removed


class Pruner:
    """checkpoint.keep's rotation in a thread of rank 0's: no rank waits at the publish barrier
    while old checkpoints are removed.  One at a time: a publish, and the end of the run,
    wait for the one before (so it never runs beside a rename into checkpoints/)."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = root, keep
        self.thread: threading.Thread | None = None

    def start(self, newest: Path) -> None:
        self.wait()
        self.thread = threading.Thread(target=self._prune, args=(newest,), name="composerun-prune")
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _prune(self, newest: Path) -> None:
        try:
            rotate(self.root, self.keep, newest)
        except Exception:  # noqa: BLE001 - a checkpoint not removed is no reason to stop training
            log.exception("removing old checkpoints from %s failed", self.root)


def publish(root: Path, tmp: Path, final: Path, meta: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """Rank 0, once every rank has written its files into `tmp`: the manifest, the rename to
    `final` (a step folder this run published before, after a resume, is swapped out) and
    `latest` naming it, each made durable before the next; then the ranks' shares go."""
    write_manifest(tmp, meta, files)
    _fsync_dir(tmp)
    old = None
    if final.exists() or final.is_symlink():
        if _published_step(final) != meta["step"]:  # not one of ours: never moved, never removed
            raise CheckpointError(f"saving {final}: something else is in its place; move it away")
        old = root / f"{final.name}.tmp-replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    point_latest(root, final)
    _fsync_dir(root)
    for share in final.iterdir():  # not in the manifest: of no use once it is written
        if SHARE.match(share.name):
            share.unlink(missing_ok=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` in place of `out` (an export: an earlier one there is
    replaced, and a reader sees the old folder or the new one, never a mix)."""
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
