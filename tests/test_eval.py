"""Evaluation (`eval.every`, `eval.batches`): the validation loss on the held-out split, the
same on every mesh, logged, summarised and reported; a run that evaluates trains exactly
what one that does not trains.  The held-out source is tests/fixtures/evaldata.py's."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, cli, compose, final_weights, read_metrics, train
from fixtures.evaldata import HELD_OUT_SIZE, NoHeldOut, TextWithVal

from composerun.config.schema import Config
from composerun.errors import ConfigError
from composerun.train.evaluate import check_eval, val_summary

WITH_VAL = ("+model=transformer", "data=text", "data._target_=fixtures.evaldata.TextWithVal", "train.seed=3")
SHORT = ("train.steps=4", "eval.every=2", "eval.batches=3", "optim.lr=3e-3")


def expected_val_loss(run_dir: Path, batches: int, batch: int, *overrides: str) -> float:
    """The loss of the run's final weights on held-out samples 0..batches*batch-1 (wrapped
    modulo the split's size), in one batch on one process: what every mesh must report."""
    cfg = compose(*overrides, validate=False)
    model = _model_with(final_weights(run_dir, *overrides), cfg)
    data = TextWithVal(cfg.model, seed=cfg.data.seed)
    x, y = data.val.batch([i % HELD_OUT_SIZE for i in range(batches * batch)])
    with torch.no_grad():
        return data.loss(model.eval()(x), y).item()


def _model_with(weights: dict[str, Any], cfg: Config) -> torch.nn.Module:
    from composerun.models import build_model

    model = build_model(cfg.model)
    model.load_state_dict(weights)
    return model


@pytest.mark.distributed
def test_val_loss_is_the_same_on_every_mesh_and_is_the_held_out_mean(tmp_path: Path) -> None:
    """Meshes 1, 2 (2 micro-batches a step: each rank's share in 2 pieces) and 2x2 (HSDP) give
    the same validation loss after steps 2 and 4, and it is the loss of the final weights on
    held-out samples 0..23 (wrapping modulo the split's 20) computed in one batch here."""
    meshes = {"1": (), "2": ("train.grad_accum=2",), "2x2": ("sharding=hsdp",)}
    results = {m: train(tmp_path / m, *WITH_VAL, *SHORT, f"mesh={m}", *extra) for m, extra in meshes.items()}
    curves = {}
    for m in meshes:
        rows = [r for r in read_metrics(tmp_path / m) if "val_loss" in r]
        assert [r["step"] for r in rows] == [2, 4], f"mesh {m}: evaluated after {[r['step'] for r in rows]}"
        for r in rows:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
        curves[m] = [r["val_loss"] for r in rows]
    for m in ("2", "2x2"):
        assert curves[m] == pytest.approx(curves["1"], rel=1e-5), f"mesh {m}: {curves[m]} vs mesh 1: {curves['1']}"
    want = expected_val_loss(tmp_path / "1", 3, 8, *WITH_VAL, *SHORT)
    assert curves["1"][-1] == pytest.approx(want, rel=1e-5)
    summary = results["2x2"]
    assert summary["last_val_loss"] == curves["2x2"][-1] and summary["last_val_step"] == 4
    assert summary["last_val_ppl"] == pytest.approx(math.exp(curves["2x2"][-1]))


@pytest.mark.distributed
def test_val_loss_of_uneven_pieces_is_the_one_batch_mean(tmp_path: Path) -> None:
    """eval.batch_size=6 on mesh 2 with a training micro-batch of 2 (data.batch_size=4): each
    rank's share of 3 is evaluated in pieces of 2 and 1, and the validation loss is still the
    loss of held-out samples 0..11 in one batch on one process (each piece weighs its size)."""
    ov = (*WITH_VAL, "train.steps=2", "eval.every=2", "eval.batches=2", "eval.batch_size=6", "data.batch_size=4")
    train(tmp_path / "run", *ov, "mesh=2")
    [row] = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert row["val_loss"] == pytest.approx(expected_val_loss(tmp_path / "run", 2, 6, *ov), rel=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of 12 steps that evaluates every 4 (each evaluation 4 batches of 64: several
    steps' time), logging every 5th step; the same run without evaluation; both in one root
    (for the report)."""
    root = tmp_path_factory.mktemp("eval")
    common = (*WITH_VAL, "train.steps=12", "optim.lr=3e-3", "eval.batches=4", "eval.batch_size=64", "train.log_every=5")
    results = {
        "eval": train(root / "eval", *common, "eval.every=4"),
        "plain": train(root / "plain", *common),
    }
    return {"root": root, "common": common, **results}


@pytest.mark.distributed
def test_val_loss_falls_and_the_summary_keeps_the_best_and_last(runs: dict[str, Any]) -> None:
    rows = read_metrics(runs["root"] / "eval")
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert list(val) == [4, 8, 12]
    assert val[12] < val[4] - 0.3, f"validation loss does not fall: {val}"
    s = runs["eval"]
    best_step = min(val, key=val.get)
    assert (s["best_val_loss"], s["best_val_step"]) == (val[best_step], best_step)
    assert (s["last_val_loss"], s["last_val_step"]) == (val[12], 12)
    assert s["last_val_ppl"] == pytest.approx(math.exp(val[12]))
    assert not any("val_loss" in r for r in read_metrics(runs["root"] / "plain"))
    assert "best_val_loss" not in runs["plain"]


@pytest.mark.distributed
def test_evaluation_changes_nothing_that_trains(runs: dict[str, Any]) -> None:
    """The same losses at every logged step and bit-identical final weights with and without
    evaluation; the evaluations' steps are logged (their values read) though log_every=5 is not due."""
    losses = {k: {r["step"]: r["loss"] for r in read_metrics(runs["root"] / k)} for k in ("eval", "plain")}
    assert list(losses["eval"]) == [1, 4, 5, 8, 10, 12] and list(losses["plain"]) == [1, 5, 10, 12]
    assert all(losses["eval"][step] == loss for step, loss in losses["plain"].items())
    got = final_weights(runs["root"] / "eval", *runs["common"])
    want = final_weights(runs["root"] / "plain", *runs["common"])
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after a run that evaluated"


@pytest.mark.distributed
def test_eval_time_is_not_step_time(runs: dict[str, Any]) -> None:
    """The steps timed across an evaluation are not charged for it: each evaluation's time
    (eval_s, a forward of 256 samples, several steps' time here) is kept out of step_s.  Step 5's
    row is the time since step 4's read, across the evaluation after step 4, and step 10's is
    steps 9 and 10 together, across the one after step 8: were the evaluation counted, step 5's
    step_s would be at least eval_s, and step 10's half of it (a bound the machine's speed does
    not move, as a comparison with other steps' times would be)."""
    rows = {r["step"]: r for r in read_metrics(runs["root"] / "eval")}
    assert {s for s, r in rows.items() if "eval_s" in r} == {4, 8, 12}, "every evaluation's row says its time"
    assert rows[5]["step_s"] < rows[4]["eval_s"], (rows[5], rows[4])
    assert rows[10]["step_s"] < rows[8]["eval_s"] / 2, (rows[10], rows[8])


def test_report_has_a_validation_column_and_curve(runs: dict[str, Any]) -> None:
    from composerun.report import write_report

    root = runs["root"]
    paths = write_report(root)
    rows = {r["run"]: r for r in csv.DictReader((root / "summary.csv").open())}
    assert float(rows["eval"]["val_loss"]) == pytest.approx(runs["eval"]["last_val_loss"], rel=1e-3)
    assert rows["plain"]["val_loss"] == ""
    assert "val_loss" in (root / "summary.md").read_text().splitlines()[0]
    assert root / "val_curves.png" in paths and (root / "val_curves.png").stat().st_size > 1000
    (root / "val_curves.png").unlink()
    plain_only = root / "plain"
    assert plain_only / "val_curves.png" not in write_report(plain_only)  # no run evaluated: no plot
    assert not (plain_only / "val_curves.png").exists()


def test_evaluation_runs_in_eval_mode_and_draws_no_random_numbers(mesh: Any) -> None:
    """On one rank: the forward sees model.training False, the model is in train mode again
    afterwards, and a model with dropout draws nothing from torch's generator (in train mode
    its dropout would)."""
    from composerun.parallel.mesh import data_parallel
    from composerun.train.evaluate import Evaluator

    cfg = compose("+model=transformer", *WITH_VAL[1:], "eval.every=1", "eval.batches=2", "eval.batch_size=4")
    data = TextWithVal(cfg.model, seed=cfg.data.seed)
    seen: list[bool] = []

    class Dropped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.drop = torch.nn.Embedding(256, 256), torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.training)
            return self.drop(self.emb(x))

    model = Dropped().train()
    ev = Evaluator(cfg, model, data, torch.device("cpu"), data_parallel(mesh))
    before = torch.get_rng_state()
    out = ev.run(1)
    assert torch.equal(torch.get_rng_state(), before), "evaluation drew random numbers"
    assert seen == [False, False] and model.training
    x, y = data.val.batch(list(range(8)))
    with torch.no_grad():
        assert out["val_loss"] == pytest.approx(data.loss(model.eval()(x), y).item(), rel=1e-6)


# --- bad configs: one line, exit 2, before any rank starts ------------------------------------------


@pytest.mark.e2e
def test_eval_without_a_held_out_split_is_refused_before_any_rank(tmp_path: Path) -> None:
    r = cli(
        "+model=transformer", "data._target_=fixtures.evaldata.NoHeldOut", "eval.every=5", "hydra.run.dir=run",
        cwd=tmp_path, env={"PYTHONPATH": str(REPO / "tests")}, timeout=120,
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "eval.every=5" in lines[0] and "no held-out split" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("data._target_=fixtures.evaldata.NoHeldOut", "eval.every=3"), "eval.every=3: data._target_="),
        (("eval.every=-1",), "eval.every=-1: must be 0"),
        (("data._target_=fixtures.evaldata.TextWithVal", "eval.every=1", "eval.batches=0"), "eval.batches=0"),
        (
            ("data._target_=fixtures.evaldata.TextWithVal", "eval.every=1", "eval.batch_size=3", "mesh=2"),
            "eval.batch_size=3 must be a positive multiple of the 2 data-parallel ranks",
        ),
    ],
)
def test_bad_eval_configs(overrides: tuple[str, ...], expected: str) -> None:
    from composerun.data import build_data

    cfg = compose("+model=transformer", "data=text", *overrides)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        check_eval(cfg, build_data(cfg))


def test_no_eval_asks_nothing_of_the_data() -> None:
    cfg = compose("+model=transformer", "data._target_=fixtures.evaldata.NoHeldOut")
    check_eval(cfg, NoHeldOut(cfg.model))  # eval.every=0: no held-out split needed


def test_val_summary_over_a_resumed_run() -> None:
    """best/last over the evaluations of the run resumed (metrics rows up to its step) and this run's."""
    earlier = [{"step": 2, "loss": 3.0}, {"step": 4, "val_loss": 2.0}, {"step": 8, "val_loss": 1.5}]
    s = val_summary([(12, 1.7), (16, 1.6)], earlier)
    assert (s["best_val_loss"], s["best_val_step"]) == (1.5, 8)
    assert (s["last_val_loss"], s["last_val_step"], s["last_val_ppl"]) == (1.6, 16, pytest.approx(math.exp(1.6)))
    assert val_summary([], [{"step": 1, "loss": 2.0}]) == {}
