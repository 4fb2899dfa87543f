"""The Checkpointer: saves (sync or async) into a tmp folder published atomically with its
manifest, an async save published at the first step boundary after every rank wrote its
part, and the load of the checkpoint the launcher chose (checkpoint/start.py, which also
recovers a finished but unpublished save before any rank starts), checked before and while
it is read."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from composerun.checkpoint.folders import Pruner, publish, step_dir_name
from composerun.checkpoint.manifest import (
    MANIFEST,
    START_OVER,
    _algorithm,
    check_checksums,
    check_contents,
    check_readable,
    share_of,
)
from composerun.checkpoint.reader import SafeReader, prefetch
from composerun.checkpoint.recovery import write_share
from composerun.checkpoint.staging import OrderedStager
from composerun.checkpoint.state import ModelState, OptimState, RNGState, TrainState, prepare_state_for_load
from composerun.checkpoint.writer import HashingFileSystem
from composerun.config.schema import CheckpointConfig
from composerun.errors import CheckpointError
from composerun.rundir import RunDir

log = logging.getLogger("composerun")


def untrusted(why: object) -> CheckpointError:
    """A checkpoint resume cannot trust (damaged, truncated, tampered): the reason, and what to do."""
    return CheckpointError(
        f"{why}; resume from another checkpoint with checkpoint.resume=PATH, or start over: {START_OVER}"
    )


def _dcp_call(what: str, fn, *args, **kwargs):
    # CheckpointException is a BaseException: re-raise as an ordinary error, which Hydra's job
    # runner (it catches Exception only) records as one failed job instead of ending a sweep
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
        ccfg: CheckpointConfig,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        meta: dict[str, Any],
    ) -> None:
        self.root = RunDir(run_dir).checkpoints
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
        self.checksum = ccfg.checksum.value
        # async: (done: written and recorded, file system, tmp, final, step) of the save in
        # flight, and its staging
        self._pending: tuple[Future, HashingFileSystem, Path, Path, int] | None = None
        self._staging: Any = None
        self._group = self._poll_group = self._stager = None
        if ccfg.async_:
            # Process groups of their own (two threads' collectives on one group would meet in
            # another order on each rank, and hang): DCP's collectives in its thread on the first;
            # the training thread's check whether every rank's write is done on the
            # second (DCP's thread may be inside a collective on the first meanwhile).  One
            # stager for the whole run, so its buffers are allocated once (reuse it, close it).
            self._group = dist.new_group(backend="gloo")
            self._poll_group = dist.new_group(backend="gloo")
            self._stager = OrderedStager()
        self._pruner = Pruner(self.root, ccfg.keep)  # rank 0's
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".probe-{uuid.uuid4().hex[:8]}"
                probe.write_text("")
                probe.unlink()
            except OSError as e:
                raise CheckpointError(f"cannot write checkpoints to {self.root}: {e.strerror}") from None
        dist.barrier()

    # -- resume ---------------------------------------------------------------------------
    def load(self, path: Path) -> None:
        """Load the checkpoint folder `path`, the one the launcher chose (checkpoint/start.py:
        the ranks never look for one).  A checkpoint that cannot be trusted fails the run,
        saying what to do."""
        # every rank: it may be a collective
        want = {
            k: tuple(v.shape) if isinstance(v, torch.Tensor) else None  # _extra_state may be anything
            for k, v in self.state["model"].state_dict().items()  # (less an adapter run's frozen base)
        }
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={path}: no such checkpoint directory")
        # The small files first, while the disk is idle: rank 0 checks every file's size, the
        # checksum of DCP's pickled .metadata (unpickled next, if only through the
        # allow-list) and the model's keys.  (Read behind the prefetch below, they would queue
        # behind its reads on a cold disk.)
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
        return bool(self.cfg.at_end or self.cfg.every > 0)

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.every
        return (last and self.cfg.at_end) or (every > 0 and step % every == 0)

    def save(self, step: int, written: Callable[[float], None] | None = None) -> float:
        """Save at `step`; returns the seconds training was blocked here (for an async save, the
        rest of the stall is `wait_staged`'s).  `written(seconds blocked so far)` is called on
        every rank once the save's data is written (sync) or the save started (async), before
        this rank records its files or publishes: before the save can be resumed from (the
        record of every rank makes it recoverable, recovery.py)."""
        t0 = time.perf_counter()
        self.finish()  # at most one save in flight
        final = self.root / step_dir_name(step)
        token = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        tmp = self.root / f"{final.name}.tmp-{token[0]}"
        writer = _Writer(tmp, final)
        # checksums while writing (nothing is read back), O_DIRECT and zip CRC-32s if asked for
        fs = HashingFileSystem(self.checksum, self.cfg.direct_io, self.cfg.zip_crc32, self.cfg.bounded_cache)
        fs.install(writer)
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
            upload = getattr(response, "upload_completion", response)
            if written is not None:
                written(time.perf_counter() - t0)
            self._pending = (self._recorded(upload, fs, tmp, step), fs, tmp, final, step)
        else:
            _dcp_call(f"saving {final}", dcp.save, self.state, storage_writer=writer)
            if written is not None:
                written(time.perf_counter() - t0)
            self._record(fs, tmp, step)
            self._publish(fs, tmp, final, step)
        return time.perf_counter() - t0

    def _recorded(self, upload: Future, fs: HashingFileSystem, tmp: Path, step: int) -> Future:
        """A future done once DCP's `upload` is and this rank has recorded its files in `tmp`
        (in DCP's thread, as soon as its write ends, whatever the training thread does; in
        this one, at once, if the write ended before the save's `written` returned)."""
        done: Future = Future()

        def record(f: Future) -> None:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
                done.set_exception(e)
                return
            try:
                self._record(fs, tmp, step)
            finally:
                done.set_result(None)

        upload.add_done_callback(record)
        return done

    def _record(self, fs: HashingFileSystem, tmp: Path, step: int) -> None:
        """This rank's share of the manifest, in `tmp` once its files are written and fsync'd:
        with every rank's there, start-up publishes a save the run stopped before publishing
        (recovery.py).  Not recorded, the save is lost only if the run stops before publishing."""
        record: dict[str, Any] = {"step": step, "world_size": self.world, "rank": self.rank, "files": fs.files}
        if self.rank == 0:
            record["meta"] = {**self.meta, "step": step, "world_size": self.world}
        try:
            write_share(tmp, self.rank, record)
        except Exception as e:  # noqa: BLE001 - the save itself is written
            log.warning("%s: rank %d's files not recorded for recovery: %s", tmp, self.rank, e)

    def wait_staged(self) -> float:
        """Before the optimizer changes weights or its state: wait until the async save in
        flight has its copy of them.  Returns the seconds waited (0.0 if nothing was staging)."""
        if self._staging is None:
            return 0.0
        t0 = time.perf_counter()
        staging, self._staging = self._staging, None
        _dcp_call("staging the checkpoint", staging.result)
        return time.perf_counter() - t0

    def poll(self) -> None:
        """At a step boundary: publish the async save in flight as soon as every rank has
        written its part, not at the next save or the end (a run stopped in between would
        lose it).  While one is in flight, every rank says whether its part is done in one
        all-reduce on a group of its own, so all ranks publish at the same step; no
        collective otherwise."""
        if self._pending is None:
            return
        done = torch.tensor([1 if self._pending[0].done() else 0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if int(done):
            self.finish()

    def finish(self) -> None:
        """Wait for the async save in flight, if any, and publish it."""
        if self._pending is None:
            return
        done, fs, tmp, final, step = self._pending
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
        self._publish(fs, tmp, final, step)

    def close(self) -> None:
        """Publish the save in flight and release the async stager's buffers and thread."""
        try:
            self.finish()
        finally:
            self._pruner.wait()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _publish(self, fs: HashingFileSystem, tmp: Path, final: Path, step: int) -> None:
        # Every rank's files are written and fsync'd once every rank has sent the sizes and
        # checksums of the files it wrote (computed as it wrote them).
        shares: list[Any] = [None] * self.world
        dist.all_gather_object(shares, fs.files)
        if self.rank == 0:
            self._pruner.wait()  # the rotation after the previous publish
            files = {name: f for share in shares for name, f in share.items()}
            publish(self.root, tmp, final, {**self.meta, "step": step, "world_size": self.world}, files)
            self._pruner.start(final)  # checkpoint.keep's, in the background: nobody waits for it
        dist.barrier()
        self.last_saved = final
