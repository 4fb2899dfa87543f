"""The torch releases composerun supports, and composerun on torch 2.11's API surface,
simulated on the installed torch (tests/fixtures/older_torch.py: DTensor calls
all_gather_tensor / reduce_scatter_tensor, and the functional collectives have no
all_gather_single / reduce_scatter_single).

- pyproject.toml's torch requirement is the range _torch_compat was checked against (2.11 to
  2.14): it takes a GPU image's torch 2.11 and torch 2.14, and nothing outside.
- The elastic agent's LaunchConfig: torch 2.11's has no shutdown_timeout (its agent waits a
  fixed 30 s); it is left out there, with a warning when another time was asked for.
- Async checkpoints' staging: torch 2.11's DCP DefaultStager copies once (it closes its copier
  at the end of every copy); composerun's stager copies every save all the same.
- Recording tensor parallelism's collectives (_torch_compat) records each collective once,
  whichever of its names is called: on the installed torch the newer name and its deprecated
  predecessor (a wrapper of it), on the older surface the older name.
- plan=true of the Llama under `tp` (mesh 2) on the older surface: nonzero tensor-parallel
  bytes, the very plan of the installed surface.
- A real 2-rank `tp` run on the older surface: ends within 1e-5 of the same model on one plain
  rank, logs that run's grad norms, and the bytes of the collectives its ranks sent (counted
  by the names the older surface has) are its plan's.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
from conftest import REPO, assert_close_weights, check_plan, compose, final_weights, read_metrics, train
from fixtures import older_torch

from composerun import _torch_compat as compat
from composerun.config.schema import LaunchConfig, StartMethod

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP loads with no group
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # torch 2.13's deprecated collective names, called here
]

STEPS = 3
LLAMA = ["+model=llama3_debug", "model.dim=64", "model.n_layers=2", "model.seq_len=16", "model.kwargs.ffn_dim=128"]
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "metrics.progress=false", "data.batch_size=4"]
TP = [*LLAMA, *COMMON, "mesh=2", "sharding=tp"]
NAMES = {
    "all_gather": ("all_gather_single", "all_gather_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_reduce": ("all_reduce",),
}


def test_pyproject_takes_the_tested_torch_releases() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert compat.TESTED == ((2, 11), (2, 15))
    for version, ok in [("2.10.2", False), ("2.11.0", True), ("2.11.0+cu130", True), ("2.13.0+cpu", True)]:
        assert torch_req.specifier.contains(version) is ok, (str(torch_req), version)
    for version, ok in [("2.14.1", True), ("2.14.9", True), ("2.15.0", False)]:
        assert torch_req.specifier.contains(version) is ok, (str(torch_req), version)
    assert compat.tested() == "2.11 to 2.14"


def _without_field(cls: type, name: str) -> type:
    """A dataclass like `cls` (its fields and defaults) without the field `name`."""
    spec = []
    for f in dataclasses.fields(cls):
        if f.name != name:
            kw = {k: getattr(f, k) for k in ("default", "default_factory") if getattr(f, k) is not dataclasses.MISSING}
            spec.append((f.name, f.type, dataclasses.field(**kw)))
    return dataclasses.make_dataclass(cls.__name__, spec)


def test_elastic_launch_config_on_a_torch_without_shutdown_timeout(monkeypatch, caplog) -> None:
    from torch.distributed.launcher import api as launcher

    args = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 2, "run_id": "x", "max_restarts": 0}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(launcher.LaunchConfig)}:  # torch 2.13 on
        lc = compat.elastic_launch_config(**args, shutdown_timeout=7)
        assert isinstance(lc, launcher.LaunchConfig) and lc.shutdown_timeout == 7 and lc.nproc_per_node == 2
        monkeypatch.setattr(launcher, "LaunchConfig", _without_field(launcher.LaunchConfig, "shutdown_timeout"))
    for timeout, warns in [(None, False), (30, False), (7, True)]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="composerun"):
            lc = compat.elastic_launch_config(**args, shutdown_timeout=timeout)
        assert not hasattr(lc, "shutdown_timeout") and lc.nproc_per_node == 2 and lc.max_restarts == 0
        said = [r.getMessage() for r in caplog.records if "shutdown_timeout" in r.getMessage()]
        assert len(said) == warns, (timeout, said)
    assert "launch.shutdown_timeout=7 does nothing" in said[0]


def test_async_staging_copies_every_save_on_torch_2_11s_stager(monkeypatch) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager

    from composerun.checkpoint.staging import OrderedStager

    if not compat.stager_stages_once():  # torch 2.13 on: torch 2.11's stager, simulated
        stage = DefaultStager._stage

        def stage_and_close(self: DefaultStager, state_dict: dict, **kwargs) -> dict:
            out = stage(self, state_dict, **kwargs)
            self._state_dict_stager.close()  # what torch 2.11 and 2.12's _stage does last
            return out

        monkeypatch.setattr(DefaultStager, "_stage", stage_and_close)
        monkeypatch.setattr(compat, "_version", lambda: (2, 11))
    stager = OrderedStager()
    try:
        for step in range(3):
            w = torch.arange(6.0) * step
            state = {"model": {"w": w}, "train": {"step": torch.tensor(step), "meta": ("adamw", [step, 1.5])}}
            got = stager.stage(state).result(timeout=60)
            assert got["model"]["w"] is not w and torch.equal(got["model"]["w"], w), step
            assert got["train"]["step"].item() == step and got["train"]["meta"] == ("adamw", [step, 1.5])
    finally:
        stager.close()


def _call(funcol, name: str, t: torch.Tensor, mesh) -> None:
    if name.startswith("all_gather"):
        out = getattr(funcol, name)(t, 0, mesh)
    elif name.startswith("reduce_scatter"):
        out = getattr(funcol, name)(t, "sum", 0, mesh)
    else:
        out = getattr(funcol, name)(t, "sum", mesh)
    funcol.wait_tensor(out)


@pytest.mark.parametrize("surface", ["installed", "older"])
def test_each_collective_is_recorded_once_by_any_of_its_names(mesh, monkeypatch, surface: str) -> None:
    funcol = importlib.import_module(older_torch.FUNCOL)
    if surface == "older":
        funcol = older_torch.simulate(monkeypatch)
        assert not hasattr(funcol, "all_gather_single") and not hasattr(funcol, "reduce_scatter_single")
    t = torch.arange(12.0).reshape(4, 3)
    before = {n: getattr(funcol, n) for names in NAMES.values() for n in names if hasattr(funcol, n)}
    called = 0
    for kind, names in NAMES.items():
        for name in (n for n in names if hasattr(funcol, n)):
            got: list[tuple[str, int]] = []
            record = got.append
            with compat.recording_functional_collectives(lambda k, x, r=record: r((k, x.numel() * x.element_size()))):
                _call(funcol, name, t, mesh)
            assert got == [(kind, 4 * 3 * 4)], f"{name}: recorded {got}"
            called += 1
    # torch 2.13 and later have both names of each renamed collective, torch 2.11 the older ones
    both = hasattr(importlib.import_module(older_torch.FUNCOL), "all_gather_single") and surface == "installed"
    assert called == (5 if both else 3)
    assert {n: getattr(funcol, n) for n in before} == before, "a collective stayed wrapped"


def test_tp_plan_on_older_torch_is_the_installed_torchs(monkeypatch) -> None:
    from composerun.parallel.planner import plan_offline

    cfg = compose(*TP, "plan.estimate=false")
    want = plan_offline(cfg)[0]
    older_torch.simulate(monkeypatch)
    got = plan_offline(cfg)[0]
    tp = {k: v for k, v in got["comm_per_step"].items() if k.startswith("tp_")}
    assert set(tp) == {"tp_all_gather", "tp_reduce_scatter", "tp_all_reduce"} and all(tp.values()), tp
    assert got == want


@pytest.mark.distributed
def test_tp_run_on_older_torch_matches_one_rank(tmp_path) -> None:
    from composerun.launch.agent import start_ranks

    reference = tmp_path / "one-rank"
    train(reference, *LLAMA, *COMMON, "mesh=1", "sharding=none")
    root = tmp_path / "older"
    jobs = [("tp", compose(*TP))]
    lcfg = LaunchConfig(start_method=StartMethod.forkserver)
    summary, comm = start_ranks(older_torch.count_collectives_on_older_torch, (jobs, str(root)), 2, root, lcfg)[0]["tp"]
    run = root / "tp"
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    assert all(math.isfinite(r["loss"]) for r in read_metrics(run))
    norms = [r["grad_norm"] for r in read_metrics(run)]
    want = [r["grad_norm"] for r in read_metrics(reference)]
    assert len(want) == STEPS and norms == pytest.approx(want, rel=1e-5), f"grad_norm {norms}, one rank {want}"
    assert_close_weights(final_weights(run, *TP), final_weights(reference, *TP), 1e-5, "tp on torch 2.11's surface")
    assert all(comm.get(k) for k in ("tp_all_gather", "tp_reduce_scatter", "tp_all_reduce")), comm
    check_plan(run, summary, comm, TP, STEPS)  # the bytes the ranks sent are the plan's
