"""Throughput accounting (composerun/train/throughput.py): tokens/s global and per rank, model
FLOPs per token, MFU only against a known peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import read_metrics, train

from composerun.train.throughput import datasheet_peak, flops_per_token, non_embedding_params, peak_flops

TEXT = ("+model=transformer", "data=text", "train.steps=3")


def transformer_6n(dim: int, layers: int, vocab: int) -> int:
    """6 x the transformer's parameters but its two embeddings, counted by hand: per block two
    LayerNorms (2 x 2*dim), q, k and v (3 dim^2), proj (dim^2), the MLP (2 x 4 dim^2); the final
    LayerNorm and the head (dim x vocab)."""
    return 6 * (layers * (12 * dim * dim + 4 * dim) + 2 * dim + dim * vocab)


@pytest.mark.distributed
def test_tokens_per_s_flops_and_mfu_in_rows_and_summary(tmp_path: Path) -> None:
    """mesh=2 with a peak set and sequences of 16 tokens: tokens/s = samples/s x 16 (the batch's
    shape), per rank half of it, FLOPs per token 6N, MFU = FLOPs x per-rank tokens/s / peak;
    the same run without a peak (on the CPU) has no MFU anywhere."""
    peak = 2e12
    shorter = ("model.seq_len=16", "model.dim=32", "model.n_layers=2")
    with_peak = train(tmp_path / "peak", *TEXT, *shorter, "mesh=2", f"metrics.peak_flops={peak}")
    no_peak = train(tmp_path / "none", *TEXT, *shorter, "mesh=2")
    six_n = transformer_6n(32, 2, 256)
    rows = read_metrics(tmp_path / "peak")
    assert rows and all("step_s" in r for r in rows)
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 16, rel=1e-12)
        assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-12)
        assert r["flops_per_token"] == six_n
        assert r["mfu"] == pytest.approx(six_n * r["tokens_per_s_per_rank"] / peak, rel=1e-12)
    s = with_peak
    assert (s["tokens_per_sample"], s["flops_per_token"], s["peak_flops"]) == (16, six_n, peak)
    assert s["tokens_per_s"] == pytest.approx(8 * 16 / s["median_step_s"], rel=1e-9)
    assert s["mfu"] == pytest.approx(six_n * s["tokens_per_s"] / 2 / peak, rel=1e-9)
    assert all("tokens_per_s" in r and "mfu" not in r for r in read_metrics(tmp_path / "none"))
    assert no_peak["peak_flops"] is None and "mfu" not in no_peak


@pytest.mark.distributed
def test_a_regression_model_has_no_token_rates(tmp_path: Path) -> None:
    s = train(tmp_path / "run", "+model=unit", "model.dim=8", "train.steps=2", "metrics.peak_flops=1e12")
    keys = {k for r in read_metrics(tmp_path / "run") for k in r} | set(s)
    assert not keys & {"tokens_per_s", "tokens_per_s_per_rank", "flops_per_token", "mfu"}


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756.5e12),  # the datasheets' sparse figures halved
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H100 NVL", 835.5e12),  # its own entry, not the SXM's
        ("NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", None),  # not the A10's figure: a GPU of its own, not in the table
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_peaks(name: str, peak: float | None) -> None:
    assert datasheet_peak(name) == peak


def test_peak_is_none_on_a_cpu_unless_set() -> None:
    assert peak_flops(None, torch.device("cpu")) is None
    assert peak_flops(3e12, torch.device("cpu")) == 3e12


def test_flops_per_token_prefers_the_models_own_count() -> None:
    class Own(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def flops_per_token(self, seq_len: int) -> float:
            return 1000.0 + seq_len

    assert flops_per_token(Own(), 64) == 1064.0


def test_embeddings_are_left_out_but_a_tied_output_weight_counts() -> None:
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    body = torch.nn.Linear(4, 4)  # 20 parameters
    untied = torch.nn.ModuleDict({"emb": emb, "body": body, "head": head})
    assert non_embedding_params(untied) == 20 + 40
    head.weight = emb.weight  # tied: the output projection is a matrix product over it
    assert non_embedding_params(untied) == 20 + 40
    assert non_embedding_params(torch.nn.ModuleDict({"emb": emb, "body": body})) == 20
    assert flops_per_token(untied, 8) == 6 * 60
