"""A run's checkpoints/ folder: its step folders, the `latest` symlink, finding the newest
complete checkpoint, and retention (which only ever removes what composerun published)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from composerun.checkpoint.manifest import MANIFEST, STEP_DIR, read_manifest, step_of
from composerun.errors import CheckpointError

LATEST = "latest"


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
    run_dir = (path / "checkpoints").is_dir()
    root = path / "checkpoints" if run_dir else path
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
    `latest` names: a stray `step-notes.txt`, a symlink or a damaged folder is left alone."""
    named = read_latest(root)
    published = [(s, p) for _, p in step_folders(root) if (s := _published_step(p)) is not None]
    keep_set = {p.name for _, p in published[-keep:]} | {newest.name} | ({named} if named else set())
    removed = []
    for _, p in published:
        if p.name not in keep_set:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
