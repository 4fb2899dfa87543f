"""Batches made ahead of the step that takes them.

A data source makes a batch on the CPU (`data.batch(indices)`), which for a long sequence
batch takes tens of milliseconds (85 ms for 4 x 8192 tokens on this VM's CPU): done inside
the step, a GPU waits for it.  `Prefetcher` makes the next `depth` micro-batches on a
background thread, in the order the steps take them, in pinned memory when the training
device is a GPU (so that the step's copy to the device is asynchronous, `non_blocking`).
The indices of every micro-batch are known in advance (the data position is the number of
samples consumed), so what a step gets is exactly what it would have made itself.

Depth 0 makes each batch in the step, as a data source that is not thread-safe needs (one
that draws from torch's global RNG, say).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class Prefetcher:
    def __init__(self, data: Any, order: Iterator[range], device: torch.device, depth: int = 2) -> None:
        """`order`: the sample indices of each micro-batch, in the order the steps take them."""
        self.data, self.order, self.device = data, order, device
        self.pin = device.type == "cuda"
        self.depth = depth
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._fill, name="composerun-prefetch", daemon=True)
            self._thread.start()

    def _make(self, indices: range) -> Batch:
        x, y = self.data.batch(indices)
        if self.pin:  # (a data source that makes its batches on the GPU already: left as is)
            x, y = (t.pin_memory() if t.device.type == "cpu" else t for t in (x, y))
        return x, y

    def _fill(self) -> None:
        try:
            for indices in self.order:
                if self._stop.is_set():
                    return
                self._put(("batch", self._make(indices)))
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
            x, y = self._make(next(self.order))
        else:
            kind, value = self._queue.get()
            if kind == "error":
                raise value
            x, y = value
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while not self._queue.empty():  # unblock a put in progress
                self._queue.get_nowait()
            self._thread.join(timeout=5)
            self._thread = None


def micro_batch_order(
    first: int, steps: range, batch: int, accum: int, micro: int, dp_rank: int
) -> Iterator[range]:
    """The indices of this replica's micro-batches, step by step: step s's global batch is the
    `batch` samples after the `first` the run started at; micro-batch m is its m-th
    `batch // accum` samples, of which this data-parallel replica takes the `dp_rank`-th `micro`."""
    for i, _ in enumerate(steps):
        for m in range(accum):
            base = first + i * batch + m * (batch // accum) + dp_rank * micro
            yield range(base, base + micro)

