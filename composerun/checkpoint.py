"""DCP checkpoints under <run>/checkpoints/step-NNNNNNNN/, published atomically.

A checkpoint is a flat dict of Stateful objects under fixed keys: `model` (FQN-keyed like
the unsharded model's state_dict()), `optim` (FQN-keyed), `train` (step and samples seen:
the data position; the LR schedule is a function of the step) and `rng` (each rank's RNG
state under its own key, `rng.rank<R>`, since DCP keeps only one copy of a key that every
rank saves: PITFALLS §3.7).  It is plain DCP: torch alone can load its `model` entry.

Publishing (PITFALLS §3.6): every rank writes into a fresh `step-N.tmp-<id>` folder
(overwrite=False), all ranks confirm, rank 0 writes `manifest.json` (step, config hash,
mesh, plan, torch version, size and checksum of every file), renames the folder to `step-N`
and then replaces `checkpoints/latest`.  A crash at any point leaves `latest` on the previous
complete checkpoint; leftover tmp folders are never resumed from and are removed at start-up.

Checksums (`checkpoint.checksum`: xxh3_128 by default, or sha256) are computed while DCP
writes each file, by the rank that writes it (composerun/writer.py, which also leaves out
torch.save's redundant CRC32s and writes the files out as they are written, through a page
cache of bounded size or with `checkpoint.direct_io` O_DIRECT), so a save never reads its files
back; a resume checks them as it loads, each rank its share of the files.

Async saves (`checkpoint.async=true`) stage the state (a copy into buffers allocated once
and reused: DCP's DefaultStager) in a background thread too, while the next step's forward
and backward run; training waits for the copy only before its optimizer updates the
weights (`wait_staged`).  DCP's writes then run in another background thread on a process
group of their own (a shared one deadlocks with training: PITFALLS §3.5); the save is
published when the next one starts, or at the end.

Loading never unpickles arbitrary objects: DCP's pickled `.metadata` is checked against the
manifest first and read through an allow-list unpickler; tensors are read with
weights_only=True.  The data files' checksums are computed as DCP's load reads them (the
reader hashes each rank's share of the files in file order, composerun/reader.py), and a
mismatch fails the run before its first step.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from composerun.errors import CheckpointError
from composerun.optim import prepare_state_for_load
from composerun.reader import SafeReader, prefetch, stored_ranks, stored_shapes
from composerun.writer import CHECKSUMS, HashingFileSystem

log = logging.getLogger("composerun")
# How to start over instead of resuming a checkpoint that cannot be used
START_OVER = "a new hydra.run.dir, or here with checkpoint.resume=never checkpoint.start_over=true"
LATEST = "latest"
MANIFEST = "manifest.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# --- the state -------------------------------------------------------------------------------


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
        set_optimizer_state_dict(self.model, self.optim, optim_state_for_load(self.model, sd))


def optim_state_for_load(model: torch.nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as torch's set_optimizer_state_dict asks for it.

    For a parameter that a module's `_fqn_modifiers` renames (FusionEmbeddingWithModifier:
    `embedding.weight` is `weight` in the state dict), torch 2.13's get_optimizer_state_dict
    keys its state by the parameter's name, while set_optimizer_state_dict asks for the
    renamed key and refuses the load without it (PITFALLS §7.2).  The same state goes under
    the key the loader asks for."""
    loader = {id(p): fqn for fqn, p in _modified_names(model)}
    renamed = {n: loader[id(p)] for n, p in model.named_parameters() if loader.get(id(p), n) != n}
    if not renamed or not any(k in osd["state"] for k in renamed):
        return osd
    return {
        **osd,
        "state": {renamed.get(k, k): v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [renamed.get(n, n) for n in g["params"]]} for g in osd["param_groups"]],
    }


def _modified_names(module: torch.nn.Module, prefix: str = "", seen: set | None = None):
    """(name, parameter) as torch's state-dict utilities name them on load: a child that its
    parent lists in `_fqn_modifiers()` adds no name of its own (torch's traversal)."""
    seen = set() if seen is None else seen
    seen.add(module)
    modifiers = set(module._fqn_modifiers().values()) if hasattr(module, "_fqn_modifiers") else set()
    for name, child in module.named_children():
        if child not in seen:
            yield from _modified_names(child, prefix if name in modifiers else f"{prefix}{name}.", seen)
    for name, p in module.named_parameters(recurse=False):
        yield f"{prefix}{name}", p


class TrainState(Stateful):
    """Step and samples consumed, as tensors so that nothing here is pickled."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.samples)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples = int(sd["step"]), int(sd["samples"])


class RNGState(Stateful):
    """This rank's RNG state, under a key of its own so that DCP keeps every rank's copy."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        sd = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return {self.key: sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd[self.key]["cpu"])
        if "cuda" in sd[self.key]:
            torch.cuda.set_rng_state(sd[self.key]["cuda"])


# --- files: checksums, manifest, safe metadata ------------------------------------------------


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


def _dcp_call(what: str, fn, *args, **kwargs):
    # CheckpointException is a BaseException: re-raise as an ordinary error (PITFALLS §3.6)
    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"{what}: {_cause(e)}") from e


def _cause(e: BaseException) -> str:
    """One line for what went wrong: DCP's CheckpointException holds every rank's exception
    and traceback; the first rank's exception is the line (a full disk: `OSError: [Errno 28]
    No space left on device`, not torch's "unexpected pos" of the zip writer it broke)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, BaseException):
            inner = getattr(inner, "composerun_os_error", None) or inner
            return f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())[:300]}"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# A step folder composerun publishes: `step-` and the step, zero-padded to 8 digits or more.
STEP_DIR = re.compile(r"^step-(\d{8,})$")


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


def step_of(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


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


def untrusted(why: object) -> CheckpointError:
    """A checkpoint resume cannot trust (damaged, truncated, tampered): the reason, and what to do."""
    return CheckpointError(
        f"{why}; resume from another checkpoint with checkpoint.resume=PATH, or start over: {START_OVER}"
    )


# --- the checkpointer ------------------------------------------------------------------------


class _Writer(FileSystemWriter):
    """DCP's file system writer into the tmp folder a save is published from: DCP's
    `.metadata` records the folder it is published as (`final`), not the tmp one, as the
    checkpoint's id."""

    def __init__(self, tmp: Path, final: Path) -> None:
        super().__init__(str(tmp), overwrite=False)
        self.final = final

    def storage_meta(self) -> Any:
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = str(self.final)
        return meta


class Checkpointer:
    def __init__(
        self,
        run_dir: Path,
        ccfg: dict[str, Any],
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        meta: dict[str, Any],
    ) -> None:
        self.root = run_dir / "checkpoints"
        self.cfg = ccfg
        self.meta = meta  # step-independent manifest fields: model, mesh, config hash, plan
        self.model = model
        self.train = TrainState()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.state: dict[str, Any] = {
            "model": ModelState(model),
            "optim": OptimState(model, optim),
            "train": self.train,
            "rng": RNGState(self.rank),
        }
        self.last_saved: Path | None = None
        self.checksum = str(getattr(ccfg.get("checksum"), "value", ccfg.get("checksum") or "xxh3_128"))
        # async: (upload future, writer, tmp, final, step) of the save in flight, and its staging
        self._pending: tuple[Any, FileSystemWriter, Path, Path, int] | None = None
        self._staging: Any = None
        self._group = self._stager = None
        if ccfg.get("async"):
            # a process group of its own (PITFALLS §3.5); one stager for the whole run, so its
            # buffers are allocated once (PITFALLS §3.5: reuse it and close it)
            self._group = dist.new_group(backend="gloo")
            accel = torch.accelerator.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=accel,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=accel,
                )
            )
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".probe-{uuid.uuid4().hex[:8]}"
                probe.write_text("")
                probe.unlink()
            except OSError as e:
                raise CheckpointError(f"cannot write checkpoints to {self.root}: {e.strerror}") from None
            for stale in self.root.glob("*.tmp-*"):  # folders of unfinished saves, a `latest` never swapped in
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
        dist.barrier()

    # -- resume ---------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the checkpoint checkpoint.resume names (auto: this run's newest); the path, or
        None when there is none.  A checkpoint that cannot be trusted fails the run, saying
        what to do."""
        mode = self.cfg["resume"]
        if mode == "never":
            return None
        # rank 0 finds the checkpoint; every rank gets its answer (or its error)
        found = self._agree(
            lambda: find_latest(self.root, strict=True) if mode == "auto" else resolve_resume(Path(mode))
        )
        if found is None:
            return None
        path = Path(found)
        # every rank: it may be a collective
        want = {
            k: tuple(v.shape) if isinstance(v, torch.Tensor) else None  # _extra_state may be anything
            for k, v in get_model_state_dict(self.model).items()
        }
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={path}: no such checkpoint directory")
        # The small files first, while the disk is idle: rank 0 checks every file's size, the
        # checksum of DCP's pickled .metadata (unpickled next, if only through the
        # allow-list) and the model's keys.  (Read behind the prefetch below, they waited
        # 0.6 s for it on a cold disk here.)
        try:
            manifest = self._agree(lambda: check_readable(path))
        except CheckpointError as e:
            raise untrusted(e) from None
        self._agree(lambda: check_contents(path, want, manifest))
        sizes = {n: f["bytes"] for n, f in manifest["files"].items() if n != ".metadata"}
        mine = share_of(sizes, self.rank, self.world)
        # A cold disk reads this rank's share of the data files while the optimizer's state
        # is built and DCP plans.
        prefetch([path / name for name in mine])
        state = dict(self.state)
        if manifest["world_size"] != self.world:
            # RNG streams are per rank: a different world size re-seeds them (documented rule)
            del state["rng"]
            torch.manual_seed(1_000_003 * manifest["step"] + self.rank)
            if self.rank == 0:
                log.warning(
                    "resuming a %d-rank checkpoint on %d ranks: RNG streams re-seeded from (step, rank)",
                    manifest["world_size"],
                    self.world,
                )
        # Each rank checks the data files' checksums of its share: hashed by the reader as it
        # loads them (DCP's `__R_*` is rank R's to load on the same world size), read again
        # only where the load did not take a file whole.  Torch reads tensors with
        # weights_only=True, and a mismatch fails the run here, before its first step.
        load_error = None
        prepare_state_for_load(self.state["optim"].optim)  # Adam's state to be filled, not computed first
        reader = SafeReader(str(path), checksums={name: _algorithm(manifest["files"][name]) for name in mine})
        try:
            _dcp_call(f"loading {path}", dcp.load, state, storage_reader=reader)
        except CheckpointError as e:
            load_error = e
        bad: list[Any] = [None] * self.world
        dist.all_gather_object(bad, check_checksums(path, manifest, mine, reader.digests))
        if any(bad) or load_error is not None:
            # nothing half-loaded may be trained on: the prepared state holds garbage
            self.state["optim"].optim.state.clear()
        if any(bad):  # the cause of a failed load, too
            raise untrusted(next(b for b in bad if b))
        if load_error is not None:
            raise untrusted(load_error)
        if self.train.step != manifest["step"]:
            self.state["optim"].optim.state.clear()
            raise untrusted(
                f"{path / MANIFEST}: says step {manifest['step']}, the checkpoint holds step {self.train.step}: "
                "the manifest was edited"
            )
        return path

    def _agree(self, check):
        """Run `check` on rank 0; every rank gets its result or raises its error."""
        out: list[Any] = [None]
        if self.rank == 0:
            try:
                out = [("ok", check())]
            except CheckpointError as e:
                out = [("error", str(e))]
            except Exception as e:  # an unreadable file, say: the other ranks must not wait for rank 0
                log.exception("checking the checkpoint failed")
                out = [("error", f"checking the checkpoint failed: {e.__class__.__name__}: {e}")]
        dist.broadcast_object_list(out, src=0)
        kind, value = out[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    # -- save -----------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether this run saves at all (checkpoint=none does not, not even when preempted)."""
        return bool(self.cfg["at_end"] or self.cfg["every"] > 0)

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg["every"]
        return (last and self.cfg["at_end"]) or (every > 0 and step % every == 0)

    def save(self, step: int) -> float:
        """Save at `step`; returns the seconds training was blocked here (for an async save, the
        rest of the stall is `wait_staged`'s)."""
        t0 = time.perf_counter()
        self.finish()  # at most one save in flight
        final = self.root / step_dir_name(step)
        token = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        tmp = self.root / f"{final.name}.tmp-{token[0]}"
        writer = _Writer(tmp, final)
        # checksums while writing (nothing is read back), O_DIRECT and zip CRC-32s if asked for
        writer.fs = HashingFileSystem(
            self.checksum, direct=bool(self.cfg.get("direct_io")), crc32=bool(self.cfg.get("zip_crc32"))
        )
        if self._group is not None:
            response = _dcp_call(
                f"saving {final}",
                dcp.async_save,
                self.state,
                storage_writer=writer,
                process_group=self._group,
                async_stager=self._stager,
            )
            self._staging = getattr(response, "staging_completion", None)
            self._pending = (getattr(response, "upload_completion", response), writer, tmp, final, step)
        else:
            _dcp_call(f"saving {final}", dcp.save, self.state, storage_writer=writer)
            self._publish(writer, tmp, final, step)
        return time.perf_counter() - t0

    def wait_staged(self) -> float:
        """Before the optimizer changes weights or its state: wait until the async save in
        flight has its copy of them.  Returns the seconds waited (0.0 if nothing was staging)."""
        if self._staging is None:
            return 0.0
        t0 = time.perf_counter()
        staging, self._staging = self._staging, None
        _dcp_call("staging the checkpoint", staging.result)
        return time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for the async save in flight, if any, and publish it."""
        if self._pending is None:
            return
        done, writer, tmp, final, step = self._pending
        self._pending, self._staging = None, None
        error = None
        try:
            _dcp_call(f"saving {final}", done.result)
        except CheckpointError as e:
            error = e
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self._group)  # every rank agrees
        if error:
            raise error
        if not int(ok):
            raise CheckpointError(f"saving {final}: another rank failed to write its part")
        self._publish(writer, tmp, final, step)

    def close(self) -> None:
        """Publish the save in flight and release the async stager's buffers and thread."""
        try:
            self.finish()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _publish(self, writer: FileSystemWriter, tmp: Path, final: Path, step: int) -> None:
        # Every rank's files are written and fsync'd once every rank has sent the sizes and
        # checksums of the files it wrote (computed as it wrote them).
        shares: list[Any] = [None] * self.world
        dist.all_gather_object(shares, writer.fs.files)
        if self.rank == 0:
            files = {name: f for share in shares for name, f in share.items()}
            write_manifest(tmp, {**self.meta, "step": step, "world_size": self.world}, files)
            _fsync_dir(tmp)
            old = None
            if final.exists() or final.is_symlink():
                if _published_step(final) != step:  # not one of ours: never moved, never removed
                    raise CheckpointError(f"saving {final}: something else is in its place; move it away")
                # this step was published before (a rerun after a resume): swap it out
                old = self.root / f"{final.name}.tmp-replaced-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            point_latest(self.root, final)
            _fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            rotate(self.root, self.cfg["keep"], final)
        dist.barrier()
        self.last_saved = final
