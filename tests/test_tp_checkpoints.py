"""Checkpoints of tensor-parallel runs (issue 22's acceptance): `llama3_debug data=tokens
mesh=2x2 sharding=fsdp_tp` trains on the shipped shards with falling train and validation
loss, and its checkpoint (FSDP over `shard`, tensor parallel over `tp`: 2-D shards) resumes
under `fsdp` on mesh 2 and under `tp` on mesh 2 (DCP reshards) with the very state it saved,
then trains on.  (The Hugging Face export of a TP run: tests/test_hf_export.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_close_weights, compose, final_weights, read_metrics, train
from fixtures.matrix import load_gather_continue
from test_checkpoint import _flat_optim, saved_optim

from composerun.config.schema import LaunchConfig, StartMethod
from composerun.launch.agent import start_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP loads with no group
]

LLAMA = ["+model=llama3_debug", "model.dim=64", "model.n_layers=2", "data=tokens", "data.seq_len=32"]
SAVED = [*LLAMA, "mesh=2x2", "sharding=fsdp_tp", "train.steps=8", "eval.every=4", "eval.batches=2", "optim.lr=3e-3"]
LCFG = LaunchConfig(start_method=StartMethod.forkserver)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("fsdp_tp") / "run"
    summary = train(run, *SAVED)
    assert summary["status"] == "ok" and summary["steps"] == 8
    return run


def test_fsdp_tp_trains_with_falling_train_and_validation_loss(saved: Path) -> None:
    rows = read_metrics(saved)
    losses = [r["loss"] for r in rows]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert losses[-1] < losses[0] and len(val) == 2 and val[-1] < val[0], (losses, val)


@pytest.mark.parametrize("target", ["fsdp-on-2", "tp-on-2"])
def test_an_fsdp_tp_checkpoint_resumes_on_another_layout_with_its_state(saved: Path, tmp_path: Path, target: str) -> None:
    policy = target.split("-")[0]
    cfg = compose(*LLAMA, "mesh=2", f"sharding={policy}", "train.steps=10", "metrics.progress=false")
    ckpt = saved / "checkpoints" / "step-00000008"
    results = start_ranks(load_gather_continue, ([(target, cfg, str(ckpt))], str(tmp_path)), 2, tmp_path, LCFG)[0]
    msd, osd, summary = results[target]
    assert_close_weights(dict(msd), final_weights(saved, *SAVED), 0.0, f"{target} model after load")
    assert_close_weights(_flat_optim(osd), saved_optim(ckpt, *SAVED), 0.0, f"{target} optimizer after load")
    assert summary["status"] == "ok" and summary["start_step"] == 8 and summary["steps"] == 10
    assert [r["step"] for r in read_metrics(tmp_path / target)] == [9, 10]
