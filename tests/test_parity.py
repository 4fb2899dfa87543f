"""Checkpoints on real gloo ranks: plain DCP that torch alone loads, and exact resume.

(Parity of every model and policy with one rank is tests/test_policies.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_close_weights, final_weights, latest_checkpoint, read_metrics, train
from torch.distributed.checkpoint import FileSystemReader

pytestmark = [
    pytest.mark.distributed,
    # DCP's no_dist mode says so on every load without a process group; that is the point here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

# width 100 = torch's CompositeModel, whose width is fixed; a checkpoint at steps 2 and 4
COMPOSITE = ["+model=composite", "model.dim=100", "train.steps=4", "checkpoint.every=2", "mesh=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Composite, 4 uninterrupted steps on 2 ranks."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(run, *COMPOSITE)
    return run


def test_torch_alone_loads_checkpoint(straight: Path) -> None:
    """A composerun checkpoint is plain DCP: torch's own CompositeModel loads its `model` entry."""
    from torch.testing._internal.common_dist_composable import CompositeModel

    ckpt = latest_checkpoint(straight)
    meta = FileSystemReader(str(ckpt)).read_metadata()
    stored = {k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")}

    torch.manual_seed(0)  # train.seed: the init composerun started from
    fresh = {k: v.clone() for k, v in CompositeModel(torch.device("cpu")).state_dict().items()}
    model = CompositeModel(torch.device("cpu"))
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(ckpt))
    model.load_state_dict(sd)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}

    assert stored == set(loaded)  # keyed exactly like the unsharded model's state_dict()
    assert all(not torch.equal(loaded[k], fresh[k]) for k in fresh), "some weights were not loaded"
    assert_close_weights(loaded, final_weights(straight, *COMPOSITE), 0.0, "torch's CompositeModel")


def test_resume_matches_uninterrupted(straight: Path, tmp_path: Path) -> None:
    """2 steps, then the same run dir again with 4 steps (resume=auto) == 4 steps straight."""
    assert latest_checkpoint(straight).name == "step-00000004"
    assert (straight / "checkpoints" / "step-00000002" / ".metadata").is_file()

    run = tmp_path / "run"
    first = train(run, *COMPOSITE, "train.steps=2")
    assert first["steps"] == 2 and Path(first["checkpoint"]).name == "step-00000002"
    second = train(run, *COMPOSITE)
    assert second["start_step"] == 2 and Path(second["resumed_from"]).name == "step-00000002"

    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], "metrics.jsonl does not continue at step 3"
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in read_metrics(straight)], rel=1e-6)
    assert latest_checkpoint(run).name == "step-00000004"
    assert_close_weights(final_weights(run, *COMPOSITE), final_weights(straight, *COMPOSITE), 1e-6, "resumed")
