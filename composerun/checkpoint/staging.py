"""The async save's copy of the state (staging), ordered after the optimizer step that made it.

DCP's DefaultStager copies the state in a background thread, on a stream of its own on a
GPU, and nothing makes that stream wait for the training stream: kernels are queued, so
when a save starts right after an optimizer step, the step's updates may still be
running on the GPU while the copy reads the weights, and the checkpoint of step k would
hold part of step k-1's.  `OrderedStager` records an event on the training thread's
current stream when the save starts (after the optimizer step, and after the state dict
is taken), and its stream waits for that event before it copies.

The copy itself is DCP's (a DefaultStager run synchronously in this stager's thread):
into CPU buffers allocated at the first save and reused, pinned where there is an
accelerator.  Each copy is waited for before the next (no `non_blocking`), so the future
`stage` returns is done only when every byte is on the CPU: the training waits for it
(Checkpointer.wait_staged) before its next optimizer step changes the weights.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from composerun import _torch_compat as compat


class OrderedStager(AsyncStager):
    """DCP's AsyncStager for dcp.async_save, one for the whole run."""

    def __init__(self) -> None:
        accel = torch.accelerator.is_available()
        # DCP's copy, synchronous here: the thread below is what makes it asynchronous.
        # Pinned memory only with an accelerator (pinning needs one: a CPU build raises).
        self.options = StagingOptions(
            use_pinned_memory=accel,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
        self.copier = DefaultStager(self.options)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="composerun-staging")
        # Made on the training thread, once its own stream is in use (DefaultStager's note:
        # made elsewhere, it could be the training stream itself).
        self.stream = torch.Stream() if accel else None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # the training waits for the copy itself, just before its optimizer step

    def stage(self, state_dict: dict[str, Any]) -> Future:
        """Start copying `state_dict` (on the training thread, right after its optimizer step);
        the future of the copy."""
        ready = None
        if self.stream is not None:
            ready = torch.Event()
            ready.record()  # on the training thread's current stream: after what it queued so far
        return self.thread.submit(self.copy, state_dict, ready)

    def copy(self, state_dict: dict[str, Any], ready: torch.Event | None) -> dict[str, Any]:
        """The copy, in this stager's thread: on its own stream, once that stream has waited
        for `ready` (the training stream's work up to the save)."""
        # torch 2.11 and 2.12's copier is spent after one copy (and keeps no buffers): one a save
        copier = DefaultStager(self.options) if compat.stager_stages_once() else self.copier
        if self.stream is None:
            return copier.stage(state_dict)
        with self.stream:
            self.stream.wait_event(ready)
            return copier.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass  # DCP waits through the future stage() returns

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.copier.close()
