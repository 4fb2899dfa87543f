"""The micro-batches a rank trains on, made ahead of the step that takes them.

The indices of every micro-batch are known in advance (`micro_batch_order`: the data
position is the number of samples consumed, and sample i is a pure function of (seed, i)),
so what a step gets is exactly what it would have made itself, on any mesh, split of the
batch or worker count: a resume needs nothing but the sample count its checkpoint records.

`Loader` takes them from a `torch.utils.data.DataLoader` whose sampler yields each
micro-batch's list of global indices (`batch_size=None`: the dataset maps the list to
`data.batch(indices)`), so its order is `micro_batch_order`'s, whatever the workers:

- `data.workers` processes make the batches (null: 2 on a CUDA device; 0 on a CPU mesh,
  where the ranks already use every core).  Each worker makes `data.prefetch` batches
  ahead (the DataLoader's prefetch_factor), round robin, and the DataLoader hands them back
  in order.  They live for the run (its whole order is one pass of the DataLoader) and are
  shut down when it ends, is preempted, or fails.
- a background thread takes the next `data.prefetch` batches from the DataLoader (with no
  workers, it is the thread that makes them: a batch of long token sequences is CPU work
  that a GPU would otherwise wait for in the step), in pinned memory when the
  training device is a GPU, so that the step's copy to the device is `non_blocking`.
- `data.prefetch=0` makes each batch in its step, in the rank's own process, as a data
  source that is not thread-safe needs (one that draws from torch's global RNG, say);
  data.workers must then be 0 (config/validate.py).

Workers are forked from the rank (multiprocessing_context="fork", whatever Python's
default): a fork starts in milliseconds and shares the data source's memory (a memory-
mapped token file is not pickled into each worker), the workers never touch the process
group or a GPU, and torch sets their thread count to 1 (a forked OpenMP runtime that ran a
parallel region hangs in its next one: tests/conftest.py).  A worker ignores the signals a
scheduler sends to the whole job (SIGTERM, SIGUSR1: its rank may need 10 more steps of
batches to agree on the stop and checkpoint, then shuts it down: the DataLoader's end
signal, SIGKILL if it has not exited 5 s later) and dies with its rank (PR_SET_PDEATHSIG),
so a SIGKILLed rank leaves no worker.

Seeds: each worker's torch, `random` and numpy generators are seeded by the DataLoader from
a base seed this module draws from (data.seed, data-parallel rank), never from the rank's
own generator (the DataLoader would otherwise draw it from torch's global RNG, in the
rank, workers or not).  A data source that draws from a worker's global RNG is therefore
repeatable for one worker count, but which worker makes which micro-batch depends on the
count, and a resumed run's workers start their generators afresh: only a source whose
sample i depends on (seed, i) alone, like every shipped one, resumes exactly.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from traceback import format_exc
from typing import Any

import torch
from torch.utils.data import DataLoader, get_worker_info

from composerun import _torch_compat as compat
from composerun.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
_PR_SET_PDEATHSIG = 1


def default_workers(workers: int | None, prefetch: int, device: torch.device) -> int:
    """data.workers, its null resolved: 2 on a CUDA device, 0 elsewhere or with data.prefetch=0
    (each batch made in its step, in the rank)."""
    if workers is not None:
        return workers
    return 2 if device.type == "cuda" and prefetch > 0 else 0


class _Failed:
    """A data source's error in a worker, handed back as a value (the DataLoader would raise
    "Caught ValueError in DataLoader worker process 1." in its place, the error's own message
    only in the traceback's text): the rank raises the error itself, its first line the
    source's, the worker's traceback a note on it.  A ConfigError stays its one line."""

    def __init__(self, error: BaseException, where: str) -> None:
        self.error, self.where = error, where

    def raise_(self) -> None:
        if self.where:
            self.error.add_note(self.where)
        raise self.error


class _Batches:
    """The DataLoader's dataset: a micro-batch's global sample indices -> data.batch(indices)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __getitem__(self, indices: Sequence[int]) -> Batch | _Failed:
        try:
            return self.data.batch(indices)
        except ConfigError as e:
            return _Failed(ConfigError(str(e)), "")
        except Exception as e:
            worker = get_worker_info()
            if worker is None:
                raise  # made in the rank: raised there as it is
            return _Failed(_portable(e), f"(made in DataLoader worker {worker.id}, pid {os.getpid()})\n{format_exc()}")


def _portable(e: Exception) -> Exception:
    """`e`, if it survives the trip back to the rank (pickled, then unpickled as its own type);
    else a RuntimeError with its type and message."""
    try:
        if type(pickle.loads(pickle.dumps(e))) is type(e):
            return e
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        pass
    return RuntimeError(f"{type(e).__name__}: {e}")


class _Order:
    """The sampler: the micro-batches' index lists, once (the DataLoader iterates it once)."""

    def __init__(self, order: Iterator[Sequence[int]]) -> None:
        self.order = order

    def __iter__(self) -> Iterator[Sequence[int]]:
        return self.order


def _as_is(batch: Any) -> Any:
    return batch


def _worker_init(worker_id: int) -> None:
    """In a worker, first: what the signals to the job do to it (see the module's docstring)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the DataLoader's own watchdog ends an orphaned worker within 5 s


def make_loader(data: Any, order: Iterable[Sequence[int]], workers: int, prefetch: int, seed: int) -> DataLoader:
    """The DataLoader over `order`'s micro-batches, in that order."""
    return DataLoader(
        _Batches(data),
        batch_size=None,
        sampler=_Order(iter(order)),
        num_workers=workers,
        collate_fn=_as_is,
        prefetch_factor=max(1, prefetch) if workers else None,
        multiprocessing_context="fork" if workers else None,
        worker_init_fn=_worker_init if workers else None,
        generator=torch.Generator().manual_seed(seed),
    )


class Loader:
    def __init__(
        self,
        data: Any,
        order: Iterator[Sequence[int]],
        device: torch.device,
        prefetch: int = 2,
        workers: int = 0,
        seed: int = 0,
    ) -> None:
        """`order`: the sample indices of each micro-batch, in the order the steps take them;
        `seed`: the workers' base seed (the caller's mix of data.seed and its replica)."""
        self.device = device
        self.pin = device.type == "cuda"
        self.depth = prefetch
        self.workers = workers
        # the iterator starts the workers now, from the rank's main thread
        self._batches: Iterator[Any] | None = iter(make_loader(data, order, workers, prefetch, seed))
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if prefetch > 0:
            self._thread = threading.Thread(target=self._fill, name="composerun-prefetch", daemon=True)
            self._thread.start()

    def _take(self) -> Batch:
        value = next(self._batches)
        if isinstance(value, _Failed):
            value.raise_()
        x, y = value
        if self.pin:  # (a data source that makes its batches on the GPU already: left as is)
            x, y = (t.pin_memory() if t.device.type == "cpu" else t for t in (x, y))
        return x, y

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                self._put(("batch", self._take()))
        except BaseException as e:  # noqa: BLE001 - the step that takes this batch raises it
            self._put(("error", e))

    def _put(self, item: tuple[str, Any]) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> Batch:
        """The next micro-batch, on the training device (its copy queued, not waited for)."""
        if self._thread is None:
            x, y = self._take()
        else:
            kind, value = self._queue.get()
            if kind == "error":
                raise value
            x, y = value
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the thread, then the workers: each told to exit and joined, killed if it has not
        exited within 5 s (a batch still being made).  Idempotent."""
        self._stop.set()
        if self._thread is not None:
            while not self._queue.empty():  # unblock a put in progress
                self._queue.get_nowait()
            self._thread.join(timeout=10)
            self._thread = None
        batches, self._batches = self._batches, None
        compat.shutdown_loader_workers(batches)


def micro_batch_order(first: int, steps: range, batch: int, accum: int, micro: int, dp_rank: int) -> Iterator[range]:
    """The indices of this replica's micro-batches, step by step: step s's global batch is the
    `batch` samples after the `first` the run started at; micro-batch m is its m-th
    `batch // accum` samples, of which this data-parallel replica takes the `dp_rank`-th `micro`."""
    for i, _ in enumerate(steps):
        for m in range(accum):
            base = first + i * batch + m * (batch // accum) + dp_rank * micro
            yield range(base, base + micro)
