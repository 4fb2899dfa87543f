"""Throughput accounting for token models: tokens/s, model FLOPs per token, MFU.

- tokens per sample: the length of the input sequences, read from the first micro-batch's
  shape ([batch, seq_len] token ids), not from the config;
- `tokens_per_s`: the global batch's tokens over the step's time; `tokens_per_s_per_rank`:
  that over the world size (each rank's share of the work: tensor-parallel peers split
  their replica's tokens' FLOPs between them);
- `flops_per_token`: the model's own `flops_per_token(seq_len)` when it has one (forward
  and backward, attention included: the Llama model's), else the standard estimate
  6 * N for a forward and backward pass (2 FLOPs a multiply-add, forward 2N, backward 4N;
  Kaplan et al. 2020), N the parameters excluding those only an nn.Embedding uses (a lookup
  is no matrix product; a weight tied to the output projection counts).  The attention
  scores' 12 * layers * dim * seq_len are not in the fallback: a model that wants them
  says so in its own method;
- `mfu` = flops_per_token * tokens_per_s_per_rank / peak FLOP/s of one rank: `metrics.peak_flops`
  when set, else the GPU's datasheet dense bf16 peak (composerun/devices.py), none on a CPU.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from composerun.devices import find_device
from composerun.models.flops import flops_per_token, non_embedding_params  # noqa: F401 - (re-exported)


def datasheet_peak(name: str) -> float | None:
    """The dense bf16 peak of a GPU named `name` (composerun/devices.py), or None where
    composerun does not know it."""
    device = find_device(name)
    return None if device is None else device.bf16_flops


def peak_flops(configured: float | None, device: torch.device) -> float | None:
    """One rank's peak FLOP/s: `metrics.peak_flops` when set, else the GPU's datasheet figure."""
    if configured:
        return float(configured)
    if device.type == "cuda":
        return datasheet_peak(torch.cuda.get_device_name(device))
    return None


class Throughput:
    """The throughput keys of a run's rows and summary; token tasks only (others get none)."""

    def __init__(self, model: torch.nn.Module, tokens: bool, batch: int, world: int, peak: float | None) -> None:
        self.model, self.tokens, self.batch, self.world, self.peak = model, tokens, batch, world, peak
        self.seq_len: int | None = None
        self.flops: float | None = None

    def observe(self, x: torch.Tensor) -> None:
        """The first micro-batch's inputs: the tokens a sample holds (its sequence length)."""
        if self.seq_len is None and self.tokens and x.dim() >= 2:
            self.seq_len = int(x.shape[1])
            self.flops = flops_per_token(self.model, self.seq_len)

    def rates(self, step_s: float) -> dict[str, float]:
        """The keys of a row whose steps took `step_s` each."""
        if self.seq_len is None or not step_s > 0:
            return {}
        tps = self.batch * self.seq_len / step_s
        out = {"tokens_per_s": tps, "tokens_per_s_per_rank": tps / self.world, "flops_per_token": self.flops}
        if self.peak:
            out["mfu"] = self.flops * out["tokens_per_s_per_rank"] / self.peak
        return out

    def summary(self, step_times: list[float]) -> dict[str, Any]:
        """summary.json's keys: the rates at the median step time, and the peak used."""
        if not step_times or self.seq_len is None:
            return {}
        out: dict[str, Any] = {**self.rates(statistics.median(step_times)), "tokens_per_sample": self.seq_len}
        out["peak_flops"] = self.peak
        return out
