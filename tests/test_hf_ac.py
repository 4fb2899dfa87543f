"""Activation checkpointing of any Hugging Face causal LM (`+model=hf`), family by family: the
shipped policies `fsdp_blocks_ac` (full; on every layer) and `fsdp_blocks_sac` (selective) find transformers'
decoder layers, and what backward recomputes says that they ran there (tests/test_activation_checkpointing.py's
way of reading it: the ops of a backward, less those of the same backward without checkpointing).
Full AC recomputes the layers' matmuls; selective keeps every matmul and the attention kernel
and recomputes the cheap ops between them; neither changes a gradient, bit for bit.  One rank in
the test process; each family's tiny random model as transformers makes it (test_hf_any.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_activation_checkpointing import KEPT, OpCounter
from test_hf_any import COMMON, FAMILIES, SEQ, VOCAB, config, make

from composerun.models import build_model
from composerun.parallel.apply import apply_policy

# the shipped policies; fsdp_blocks_ac's rule checkpoints every second layer unless told otherwise
POLICIES = {"none": ["sharding=fsdp_blocks"], "full": ["sharding=fsdp_blocks_ac", "sharding.rules.0.every=1"],
            "selective": ["sharding=fsdp_blocks_sac"]}  # fmt: skip
MATMULS = ("aten.mm", "aten.addmm")  # a Linear without and with a bias (Qwen2's q, k, v)


def _step(directory: Path, policy: str, mesh: Any, tokens: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor]]:
    """One forward and backward of the family's model under `policy`: (backward ops, full gradients)."""
    cfg = config(directory, *POLICIES[policy])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_policy(model, cfg.sharding, mesh)
    loss = model(tokens).float().logsumexp(-1).mean()
    with OpCounter() as bwd:
        loss.backward()
    return bwd.ops, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_recomputes_what_each_mode_drops(mesh: Any, tmp_path: Path, family: str) -> None:
    make(tmp_path, family)
    tokens = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    runs = {policy: _step(tmp_path, policy, mesh, tokens) for policy in POLICIES}
    base = runs["none"][0]
    full, selective = runs["full"][0] - base, runs["selective"][0] - base
    layers = COMMON["num_hidden_layers"]
    # full: each layer's forward again, its projections among it (Phi-3 packs q, k, v in one, and
    # gate and up in another: at least two matmuls a layer in every family), and its attention
    assert sum(full[op] for op in MATMULS) >= 2 * layers and full[KEPT[1]] == layers, f"{family}: full AC recomputed {dict(full)}"
    # selective: no matmul or attention kernel run again, the cheap ops between them are
    assert all(selective[op] == 0 for op in (*MATMULS, *KEPT)), f"{family}: selective AC recomputed {dict(selective)}"
    assert sum(selective.values()) > 0, f"{family}: selective AC recomputed nothing: it did not run"
    assert sum(full.values()) > sum(selective.values()), family
    for policy in ("full", "selective"):  # recomputing changes no gradient
        for name, g in runs[policy][1].items():
            torch.testing.assert_close(g, runs["none"][1][name], rtol=0, atol=0, msg=f"{family} {policy} {name}")
