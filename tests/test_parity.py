"""Parity and checkpoint round trips on real gloo ranks (distributed tier).

Every reference model trains on meshes 1, 2 and 2x2 from the same seed in fp32, and the
final weights on 2 and 2x2 equal the 1-rank run's (PITFALLS §4.3: same init, same global
batches, atol 1e-6).  The weights are read back from the run's DCP checkpoint with no
process group at all (DCP's no_dist mode, PITFALLS §3.8), into the plain unsharded model.

Each (model, mesh) run happens at most once per session: `runs` caches the result (or the
failure) and every test that needs that run reuses it.  The composite runs double as the
inputs of the torch-only load test and of the resume test, so they use width 100 (torch's
own CompositeModel has no width argument) and checkpoint every 2 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import compose, read_metrics, train
from torch.distributed.checkpoint import FileSystemReader

from composerun.data import SyntheticData
from composerun.models import build_model

pytestmark = [
    pytest.mark.distributed,
    # DCP's no_dist mode says so on every load without a process group; that is the point here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

STEPS = 4
MESHES = ["1", "2", "2x2"]
ATOL = 1e-6

# Tiny widths: start-up dominates the time of every run, not the model.
MODELS: dict[str, list[str]] = {
    "unit": ["model.dim=16"],
    # width 100 = torch's CompositeModel; checkpoints at step 2 and 4 for the resume test
    "composite": ["model.dim=100", "checkpoint.every=2"],
    "unit_param": ["model.dim=16"],
    "composite_param": ["model.dim=16"],
    # 1 feature in, 4 out: at lr 1e-3 and 8 samples a step, batch noise hides 4 steps of learning
    "nested_sequential": ["optim.lr=3e-2", "data.batch_size=64"],
    "fusion_embedding": [],
    "fusion_embedding_with_hook": [],
    "fusion_embedding_with_modifier": [],
    "transformer": ["model.dim=32", "model.n_layers=2", "model.seq_len=8"],
}
REGRESSION = {"unit", "composite", "unit_param", "composite_param", "nested_sequential"}


def overrides(model: str, *extra: str) -> list[str]:
    return [f"+model={model}", *MODELS[model], f"train.steps={STEPS}", "train.seed=0", *extra]


def latest_checkpoint(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    path = root / (root / "latest").read_text().strip()
    assert (path / ".metadata").is_file(), f"{path} is not a complete DCP checkpoint"
    return path


def checkpoint_model_keys(ckpt: Path) -> set[str]:
    """The `model` entry's keys as stored in the checkpoint's metadata (flattened `model.<fqn>`)."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    return {k.removeprefix("model.") for k in md.state_dict_metadata if k.startswith("model.")}


def load_final_weights(model: str, ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's `model` entry loaded into the plain unsharded model, without a process group."""
    torch.manual_seed(12345)  # any init: every tensor must come from the checkpoint
    module = build_model(compose(*overrides(model))["model"])
    sd = module.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(ckpt))
    return {k: v.detach().clone() for k, v in sd.items()}


def heldout_loss(model: str, weights: dict[str, torch.Tensor] | None) -> float:
    """Loss on one fixed batch of samples no run trains on: the trained weights, or the seeded init (None)."""
    cfg = compose(*overrides(model))
    torch.manual_seed(cfg["train"]["seed"])
    module = build_model(cfg["model"])
    if weights is not None:
        module.load_state_dict(weights)
    data = SyntheticData(SimpleNamespace(**cfg["model"]), seed=cfg["data"]["seed"])
    x, y = data.batch(range(10**6, 10**6 + 256))
    with torch.no_grad():
        return float(data.loss(module(x), y))


@dataclass
class Run:
    dir: Path
    summary: dict[str, Any] | None = None
    error: BaseException | None = None

    def ok(self) -> Run:
        if self.error is not None:
            pytest.fail(f"the run in {self.dir} failed earlier: {type(self.error).__name__}: {self.error}")
        return self


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """runs(model, mesh) -> the Run, trained on first use and reused after (or its failure)."""
    cache: dict[tuple[str, str], Run] = {}

    def get(model: str, mesh: str) -> Run:
        key = (model, mesh)
        if key not in cache:
            run = Run(tmp_path_factory.mktemp(f"{model}-{mesh}") / "run")
            try:
                run.summary = train(run.dir, *overrides(model, f"mesh={mesh}"))
            except Exception as e:  # kept, so that a failed run is never started again
                run.error = e
                cache[key] = run
                raise
            cache[key] = run
        return cache[key].ok()

    return get


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: state-dict keys differ"
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k} shape {tuple(got[k].shape)} != {tuple(want[k].shape)}"
    diffs = {k: (got[k].float() - want[k].float()).abs().max().item() if want[k].numel() else 0.0 for k in want}
    bad = {k: f"{d:.3g}" for k, d in diffs.items() if not d <= ATOL}
    assert not bad, f"{what}: max |diff| over atol {ATOL}: {bad}"


def test_torch_alone_loads_checkpoint(runs) -> None:
    """A composerun checkpoint is plain DCP: torch's own CompositeModel loads its `model` entry."""
    run = runs("composite", "2")
    ckpt = latest_checkpoint(run.dir)

    from torch.testing._internal.common_dist_composable import CompositeModel

    torch.manual_seed(0)  # train.seed: the same init composerun starts from
    fresh = {k: v.detach().clone() for k, v in CompositeModel(torch.device("cpu")).state_dict().items()}
    torch.manual_seed(0)
    model = CompositeModel(torch.device("cpu"))
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(ckpt))
    model.load_state_dict(sd)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}

    assert set(loaded) == checkpoint_model_keys(ckpt)
    assert all(not torch.equal(loaded[k], fresh[k]) for k in fresh), "some weights were not loaded (still fresh)"
    assert_same_weights(loaded, load_final_weights("composite", ckpt), "torch's CompositeModel vs composerun's")


def test_resume_matches_uninterrupted(runs, tmp_path: Path) -> None:
    """2 steps, then the same run dir again with 4 steps (resume=auto) == 4 steps straight."""
    straight = runs("composite", "2")  # train.steps=4, checkpoint.every=2
    straight_ckpt = latest_checkpoint(straight.dir)
    assert straight_ckpt.name == "step-00000004"
    assert (straight.dir / "checkpoints" / "step-00000002" / ".metadata").is_file()

    run_dir = tmp_path / "run"
    first = train(run_dir, *overrides("composite", "mesh=2", "train.steps=2"))
    assert first["steps"] == 2 and Path(first["checkpoint"]).name == "step-00000002"
    second = train(run_dir, *overrides("composite", "mesh=2"))
    assert second["start_step"] == 2
    assert second["resumed_from"] is not None and Path(second["resumed_from"]).name == "step-00000002"

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], "metrics.jsonl does not continue at step 3"
    straight_losses = [r["loss"] for r in read_metrics(straight.dir)]
    assert [r["loss"] for r in rows] == pytest.approx(straight_losses, rel=1e-5, abs=1e-6)

    ckpt = latest_checkpoint(run_dir)
    assert ckpt.name == "step-00000004"
    assert_same_weights(
        load_final_weights("composite", ckpt),
        load_final_weights("composite", straight_ckpt),
        "resumed vs uninterrupted",
    )


# Last in the file, so that under -x a failing cell does not hide the two tests above.
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", list(MODELS))
def test_trains_and_matches_one_rank(runs, model: str, mesh: str) -> None:
    run = runs(model, mesh)
    s = run.summary
    assert s["status"] == "ok"
    assert s["steps"] == STEPS and s["start_step"] == 0

    rows = read_metrics(run.dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in rows), [r["loss"] for r in rows]
    assert s["first_loss"] == pytest.approx(rows[0]["loss"]) and s["final_loss"] == pytest.approx(rows[-1]["loss"])
    if model in REGRESSION:
        assert s["final_loss"] < s["first_loss"], f"{model} on {mesh}: loss did not fall: {[r['loss'] for r in rows]}"

    ckpt = latest_checkpoint(run.dir)
    assert Path(s["checkpoint"]) == ckpt
    weights = load_final_weights(model, ckpt)
    # The checkpoint is keyed exactly like nn.Module.state_dict() of the unsharded model.
    assert checkpoint_model_keys(ckpt) == set(weights)
    if model in REGRESSION:  # the same fixed batch before and after: no batch noise
        before, after = heldout_loss(model, None), heldout_loss(model, weights)
        assert after < before, f"{model} on {mesh}: held-out loss {before:.4g} -> {after:.4g}"
    if mesh == "1":
        return

    ref = runs(model, "1")
    ref_ckpt = latest_checkpoint(ref.dir)
    assert checkpoint_model_keys(ckpt) == checkpoint_model_keys(ref_ckpt)
    assert_same_weights(weights, load_final_weights(model, ref_ckpt), f"{model}: mesh {mesh} vs 1")
    # Same global batches: the logged global losses agree too.
    ref_losses = [r["loss"] for r in read_metrics(ref.dir)]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
