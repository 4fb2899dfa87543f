"""Every checkpoint's manifest.json (step, config, mesh, plan, torch version, each file's
size and checksum) and the checks a resume makes against it before and while it loads."""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import torch

from composerun.checkpoint.reader import stored_ranks, stored_shapes
from composerun.checkpoint.writer import CHECKSUMS
from composerun.errors import CheckpointError

MANIFEST = "manifest.json"
# A step folder composerun publishes: `step-` and the step, zero-padded to 8 digits or more.
STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_of(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


# How to start over instead of resuming a checkpoint that cannot be used
# How to start over instead of resuming a checkpoint that cannot be used
START_OVER = "a new hydra.run.dir, or here with checkpoint.resume=never checkpoint.start_over=true"

_BLOCK = 1 << 24


def _algorithm(entry: dict[str, Any]) -> str | None:
    return next((a for a in CHECKSUMS if a in entry), None)


def file_checksum(path: Path, algorithm: str) -> str:
    """The file's checksum, read through mmap (no copy out of the page cache)."""
    h = CHECKSUMS[algorithm]()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                m.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(m)
                try:
                    for i in range(0, size, _BLOCK):
                        h.update(view[i : i + _BLOCK])
                finally:
                    view.release()
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def share_of(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files this rank checks (the same split on every rank).  DCP's `__R_N.distcp` goes
    to rank R, which on the same world size is the rank that has just loaded it, so the
    check reads it from the page cache; every other file goes to the least-loaded rank,
    the largest first."""
    load, mine = [0] * world, []
    owner = {}
    for name in sizes:
        m = re.match(r"__(\d+)_", name)
        if m and int(m.group(1)) < world:
            owner[name] = int(m.group(1))
            load[owner[name]] += sizes[name]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = owner.get(name)
        if r is None:
            r = load.index(min(load))
            load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def hash_files(ckpt: Path, algorithm: str = "xxh3_128") -> dict[str, dict[str, Any]]:
    """{name: {bytes, <algorithm>}} of every file of a checkpoint folder, read back."""
    return {
        p.name: {"bytes": p.stat().st_size, algorithm: file_checksum(p, algorithm)}
        for p in sorted(ckpt.iterdir())
        if p.name != MANIFEST
    }


def write_manifest(ckpt: Path, meta: dict[str, Any], files: dict[str, dict[str, Any]] | None = None) -> None:
    """The manifest, with `files` ({name: {bytes, <algorithm>}}: every file, hashed by the ranks
    as they wrote it), or with every file read back and hashed here."""
    files = dict(sorted((files if files is not None else hash_files(ckpt)).items()))
    body = {**meta, "torch_version": torch.__version__, "files": files}
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(ckpt / MANIFEST)


def read_manifest(ckpt: Path) -> dict[str, Any]:
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; not a complete composerun checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e.__class__.__name__}); the checkpoint is damaged") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(f, dict) and "bytes" in f and _algorithm(f) for f in files.values()
    ):
        raise CheckpointError(f"{path}: no valid file list; the checkpoint is damaged")
    return manifest


def check_integrity(ckpt: Path, checksums: bool = True) -> dict[str, Any]:
    """The manifest, once every file it lists is there with its size (and checksum, unless the
    caller checks the checksums itself: check_checksums)."""
    manifest = read_manifest(ckpt)
    for name, want in manifest["files"].items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {want['bytes']}: truncated or damaged")
    if checksums:
        bad = check_checksums(ckpt, manifest, list(manifest["files"]))
        if bad:
            raise CheckpointError(bad)
    return manifest


def check_manifest_fields(ckpt: Path, manifest: dict[str, Any]) -> None:
    """The manifest's own fields must agree with each other and with the folder they describe:
    a hand-edited step or world size is refused, as a damaged file is."""
    where = ckpt / MANIFEST
    step, world, mesh = manifest.get("step"), manifest.get("world_size"), manifest.get("mesh")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: step {step!r} is not a step number; the checkpoint is damaged")
    if step_of(ckpt) >= 0 and step_of(ckpt) != step:
        raise CheckpointError(f"{where}: says step {step} but the folder is {ckpt.name}: the manifest was edited")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{where}: world_size {world!r} is not a number of ranks; the checkpoint is damaged")
    if isinstance(mesh, str) and re.fullmatch(r"\d+(x\d+)*", mesh):
        ranks = 1
        for n in mesh.split("x"):
            ranks *= int(n)
        if ranks != world:
            raise CheckpointError(
                f"{where}: mesh {mesh} is {ranks} ranks but world_size says {world}: the manifest was edited"
            )


def check_stored_ranks(ckpt: Path, manifest: dict[str, Any]) -> None:
    """Every rank of the saving run stored its RNG state under its own key (`rng.rank<R>`):
    those keys must be the manifest's world size."""
    ranks = stored_ranks(ckpt)
    if ranks and ranks != set(range(manifest["world_size"])):
        raise CheckpointError(
            f"{ckpt / MANIFEST}: says world_size {manifest['world_size']}, the checkpoint holds the state of "
            f"{len(ranks)} ranks: the manifest was edited"
        )


def check_readable(path: Path) -> dict[str, Any]:
    """What a resume checks before it reads any tensor (rank 0, and the launcher before any
    rank starts): every file is there with its size, the manifest's fields agree, and DCP's
    pickled .metadata has its checksum (it is unpickled next, if only through the allow-list).
    The data files' checksums are checked as the load reads them.  Returns the manifest."""
    manifest = check_integrity(path, checksums=False)
    check_manifest_fields(path, manifest)
    if ".metadata" in manifest["files"]:
        bad = check_checksums(path, manifest, [".metadata"])
        if bad:
            raise CheckpointError(bad)
    return manifest


def check_contents(path: Path, want: dict[str, tuple[int, ...] | None], manifest: dict[str, Any]) -> None:
    """The stored model is this model: the same keys, the same shapes; and the stored ranks
    are the manifest's world size."""
    check_stored_ranks(path, manifest)
    have = stored_shapes(path, "model")
    fix = f"resume another checkpoint, or start over: {START_OVER}"
    if set(want) != set(have):
        missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        raise CheckpointError(
            f"{path} holds another model ({manifest.get('model')}): missing keys {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; {fix}"
        )
    for key, shape in want.items():
        if shape is not None and have[key] is not None and tuple(have[key]) != shape:
            raise CheckpointError(
                f"{path} holds another size of this model ({manifest.get('model')}): {key} is "
                f"{list(have[key])} there, {list(shape)} here (another model.dim?); {fix}"
            )


def check_checksums(
    ckpt: Path, manifest: dict[str, Any], names: list[str], known: dict[str, str] | None = None
) -> str | None:
    """The error line for the first of `names` whose checksum differs from the manifest's, or
    None.  `known`: checksums already computed ({name: digest}, with the manifest's algorithm);
    the other files are read and hashed here."""
    for name in names:
        entry = manifest["files"][name]
        algorithm = _algorithm(entry)
        digest = (known or {}).get(name) or file_checksum(ckpt / name, algorithm)
        if digest != entry[algorithm]:
            return f"{ckpt / name}: checksum mismatch with {MANIFEST}: the file was modified"
    return None
