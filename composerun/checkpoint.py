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
from composerun.reader import SafeReader, prefetch, stored_shapes
from composerun.writer import CHECKSUMS, HashingFileSystem

log = logging.getLogger("composerun")
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
        text = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{what}: {type(e).__name__}: {text}") from e


def find_latest(root: Path, strict: bool = False) -> Path | None:
    """The newest complete checkpoint: `latest` if it names one, else the newest step-N with a manifest.

    strict (a resume): a step-N folder newer than that one but without a manifest is an
    error, not skipped.  A save only ever renames a complete folder into place, so such a
    folder was damaged after it was saved, and resuming from an older one would silently
    train its steps again."""
    pointer = root / LATEST
    name = pointer.read_text().strip() if pointer.is_file() else ""
    found = root / name if name and (root / name / MANIFEST).is_file() else None
    steps = sorted(p for p in root.glob("step-*") if ".tmp-" not in p.name and p.is_dir())
    if found is None:
        done = [p for p in steps if (p / MANIFEST).is_file()]
        found = done[-1] if done else None
    if strict:
        damaged = [p for p in steps if not (p / MANIFEST).is_file() and (found is None or p.name > found.name)]
        if damaged:
            then = f"to resume from {found}, the newest complete one" if found else "to start over"
            raise CheckpointError(
                f"{damaged[-1]}: no {MANIFEST}, not a complete checkpoint (damaged after its save); move it "
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
    if not (run_dir or (root / LATEST).is_file() or any(root.glob("step-*"))):
        return path  # not a run's checkpoints: the integrity check says what is missing
    found = find_latest(root, strict=True)
    if found is None:
        raise CheckpointError(
            f"checkpoint.resume={path}: no complete checkpoint in it; name one (checkpoints/step-N) "
            "or start over with checkpoint.resume=never"
        )
    return found


def _untrusted(why: object) -> CheckpointError:
    """A checkpoint resume cannot trust (damaged, truncated, tampered): the reason, and what to do."""
    return CheckpointError(
        f"{why}; resume from another checkpoint with checkpoint.resume=PATH, or start over with checkpoint.resume=never"
    )


# --- the checkpointer ------------------------------------------------------------------------


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
                if stale.is_dir():
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
            manifest = self._agree(lambda: self._check_before_load(path))
        except CheckpointError as e:
            raise _untrusted(e) from None
        self._agree(lambda: self._check_keys(path, want, manifest))
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
            raise _untrusted(next(b for b in bad if b))
        if load_error is not None:
            raise _untrusted(load_error)
        return path

    @staticmethod
    def _check_before_load(path: Path) -> dict[str, Any]:
        manifest = check_integrity(path, checksums=False)
        if ".metadata" in manifest["files"]:
            bad = check_checksums(path, manifest, [".metadata"])
            if bad:
                raise CheckpointError(bad)
        return manifest

    def _check_keys(self, path: Path, want: dict[str, tuple[int, ...] | None], manifest: dict[str, Any]) -> None:
        have = stored_shapes(path, "model")
        fix = "resume another checkpoint, or start over with checkpoint.resume=never or a new hydra.run.dir"
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
        writer = FileSystemWriter(str(tmp), overwrite=False)
        # checksums while writing (nothing is read back), O_DIRECT if asked for
        writer.fs = HashingFileSystem(self.checksum, direct=bool(self.cfg.get("direct_io")))
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
            if final.exists():  # this step was published before (a rerun after a resume): swap it out
                old = self.root / f"{final.name}.tmp-replaced-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            pointer_tmp = self.root / f"{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
            pointer_tmp.write_text(final.name + "\n")
            os.replace(pointer_tmp, self.root / LATEST)
            _fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            kept = sorted(p for p in self.root.glob("step-*") if ".tmp-" not in p.name)
            for old in kept[: -self.cfg["keep"]]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        self.last_saved = final
