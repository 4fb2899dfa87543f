"""composerun.checkpoint.state.prepare_state_for_load, in process on one gloo rank with FSDP2 (DTensor) parameters.

Resume gives Adam/AdamW NaN-filled state tensors for DCP to fill instead of letting the
state-dict utilities compute a whole optimizer step on zero gradients.  That is only sound
if the state it makes is laid out exactly as the utilities' own (so that the load fills
every tensor, and a checkpoint lacking any of it fails DCP's strict load), and if training
on from it is bit-for-bit what training on from the utilities' state is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import one_rank_mesh
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from composerun.checkpoint.reader import SafeReader
from composerun.checkpoint.state import prepare_state_for_load
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.models.reference import CompositeModel

VARIANTS = {
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}),
    "adam-amsgrad": (torch.optim.Adam, {"amsgrad": True}),
    "adam-for-loop": (torch.optim.Adam, {"foreach": False}),
}


@pytest.fixture(scope="module")
def mesh():
    """conftest's `mesh` (a 1-rank gloo group and its device mesh on a private HashStore), once
    for the module's in-process tests rather than once a test: each teardown collects the
    garbage of the whole process.  The module's launches start their ranks from the fork
    server, not from this process; the group is destroyed, and collected, after the module."""
    with one_rank_mesh() as device_mesh:
        yield device_mesh


def build(mesh, cls, kwargs, freeze: bool = False):
    torch.manual_seed(0)
    model = CompositeModel(8)
    if freeze:
        model.l1.weight.requires_grad_(False)  # no gradient, so no Adam state
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, cls(model.parameters(), lr=1e-2, **kwargs)


def train_steps(model, optim, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def layout(sd: dict) -> dict:
    """Everything about each tensor of an optimizer state dict but its values."""
    out = {}
    for fqn, entry in sd["state"].items():
        for key, t in entry.items():
            desc = (type(t).__name__, t.dtype, t.device.type, tuple(t.shape), t.requires_grad)
            if isinstance(t, DTensor):
                local = t.to_local()
                desc += (tuple(t.placements), tuple(local.shape), local.stride())
            else:
                desc += (t.stride(),)
            out[f"{fqn}.{key}"] = desc
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("freeze", [False, True], ids=["all", "frozen"])
def test_prepared_state_is_laid_out_as_the_utilities(mesh, variant: str, freeze: bool) -> None:
    cls, kwargs = VARIANTS[variant]
    model, optim = build(mesh, cls, kwargs, freeze)
    want = get_optimizer_state_dict(model, optim)  # the utilities' zero-gradient step
    model, optim = build(mesh, cls, kwargs, freeze)
    assert prepare_state_for_load(optim)
    assert len(optim.state) == sum(p.requires_grad for p in model.parameters())
    got = get_optimizer_state_dict(model, optim)
    assert layout(got) == layout(want)
    assert got["param_groups"] == want["param_groups"]
    # the utilities' zero-gradient step did not run: it would have counted step 1
    assert all(float(e["step"]) == 0 for e in got["state"].values())
    assert all(float(e["step"]) == 1 for e in want["state"].values())
    if freeze:
        assert not any(k.startswith("l1.weight.") for k in layout(got))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_prepared_moments_are_nan_whether_or_not_torch_fills_new_memory(mesh, deterministic: bool) -> None:
    """The fill is the first touch of the state's memory, made while a resume's disk reads
    (composerun's runs are deterministic by default, and torch's deterministic mode fills new
    tensors with NaN itself); and an element a load missed would show."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        _, optim = build(mesh, torch.optim.AdamW, {})
        assert prepare_state_for_load(optim)
    finally:
        torch.use_deterministic_algorithms(before, warn_only=True)
    moments = [t.to_local() for e in optim.state.values() for k, t in e.items() if k != "step"]
    assert moments and all(t.isnan().all() for t in moments)


def full_state(optim) -> dict:
    return {
        (id(p), k): (t.full_tensor() if isinstance(t, DTensor) else t).clone()
        for p, e in optim.state.items()
        for k, t in e.items()
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_on_from_a_prepared_load_is_exact(mesh, tmp_path: Path, variant: str) -> None:
    cls, kwargs = VARIANTS[variant]
    model, optim = build(mesh, cls, kwargs)
    train_steps(model, optim, 3, seed=1)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=tmp_path
    )
    saved = list(full_state(optim).values())

    finals = []
    for prepare in (False, True):
        model, optim = build(mesh, cls, kwargs)
        if prepare:
            assert prepare_state_for_load(optim)
            for entry in optim.state.values():  # an element the load missed would stay NaN
                for t in entry.values():
                    (t.to_local() if isinstance(t, DTensor) else t).fill_(float("nan"))
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        # composerun's reader, as a resume uses it
        dcp.load(state, storage_reader=SafeReader(str(tmp_path)))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        loaded = list(full_state(optim).values())
        assert len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True))
        train_steps(model, optim, 2, seed=2)
        finals.append([p.full_tensor() for p in model.parameters()])
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_lacking_some_state_fails_the_load(mesh, tmp_path: Path) -> None:
    """Uninitialised tensors are never left unfilled: DCP refuses a load that does not cover them."""
    model, optim = build(mesh, torch.optim.Adam, {})
    train_steps(model, optim, 1, seed=1)
    dcp.save({"optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=tmp_path)
    model, optim = build(mesh, torch.optim.Adam, {"amsgrad": True})
    assert prepare_state_for_load(optim)
    with pytest.raises(CheckpointException) as e:
        dcp.load({"optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=tmp_path)
    assert "Missing key in checkpoint state_dict: optim.state.l1.weight.max_exp_avg_sq" in str(e.value.failures[0])


def test_other_optimizers_keep_the_utilities_way(mesh) -> None:
    class MyAdam(torch.optim.Adam):  # a subclass may keep other state
        pass

    for cls in (torch.optim.SGD, MyAdam):
        _, optim = build(mesh, cls, {})
        assert not prepare_state_for_load(optim) and not optim.state
    model, optim = build(mesh, torch.optim.AdamW, {})
    train_steps(model, optim, 1, seed=1)
    before = {id(t) for s in optim.state.values() for t in s.values()}
    assert not prepare_state_for_load(optim)  # it has state already: left alone
    assert before == {id(t) for s in optim.state.values() for t in s.values()}


# --- the LR schedule: a pure function of (step, train.steps, optim) ----------------------------


def spec_factor(s: int, steps: int, warmup: int, kind: str, lo: float) -> float:
    """The schedule as specified: linear warmup (s+1)/(warmup+1), then a decay whose fraction
    is (s - warmup) / max(1, steps - 1 - warmup), reaching min_lr_ratio at the last step."""
    import math

    if s < warmup:
        return (s + 1) / (warmup + 1)
    frac = min(1.0, (s - warmup) / max(1, steps - 1 - warmup))
    return lo + (1 - lo) * (0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1 - frac)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@pytest.mark.parametrize(("steps", "warmup"), [(1, 0), (2, 0), (5, 0), (5, 2), (20, 3), (7, 5)])
def test_every_step_follows_the_schedule_and_the_last_trains_at_min_lr(kind: str, steps: int, warmup: int) -> None:
    from composerun.config.schema import OptimConfig, Schedule
    from composerun.train.optim import lr_factor, set_lr

    ocfg = OptimConfig(lr=3e-3, warmup_steps=warmup, schedule=Schedule(kind), min_lr_ratio=0.1)
    got = [lr_factor(s, steps, ocfg) for s in range(steps)]
    assert got == pytest.approx([spec_factor(s, steps, warmup, kind, 0.1) for s in range(steps)], rel=1e-12)
    optim = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    last = set_lr(optim, steps - 1, steps, ocfg)
    assert last == optim.param_groups[0]["lr"] == ocfg.lr * got[-1]
    if steps - 1 > warmup:  # a decay step is the last: it trains at exactly lr * min_lr_ratio
        assert last == ocfg.lr * ocfg.min_lr_ratio
        # past the end (a checkpoint's schedule, when a resume extends its run) the LR stays there
        assert lr_factor(steps + 3, steps, ocfg) == ocfg.min_lr_ratio


# --- the grad norm, reduced in the step's one all-reduce ---------------------------------------


CASES = {"2": {"fsdp": ("fused", 0.0), "ddp": ("local", 0.0)}, "2x2": {"hsdp": ("fused", 0.0), "fsdp": ("fused", 0.0)}}
MAX_NORM = 0.5  # test_grad_norm_over_every_mesh_a_policy_uses


@pytest.fixture(scope="module")
def gradnorm_runs(tmp_path_factory: pytest.TempPathFactory):
    """mesh -> what its ranks returned, on first use (tests/fixtures/gradnorm.py)."""
    from conftest import compose
    from fixtures.gradnorm import norms_and_reductions

    from composerun.launch.agent import start_ranks

    done: dict[str, Any] = {}

    def get(mesh: str) -> Any:
        if mesh not in done:
            root = tmp_path_factory.mktemp(f"gradnorm{mesh}")
            jobs = [
                (p, compose("+model=composite", "model.dim=10", f"mesh={mesh}", f"sharding={p}", "checkpoint=none"))
                for p in CASES[mesh]
            ]
            lcfg = LaunchConfig(start_method=StartMethod.forkserver)
            done[mesh] = start_ranks(norms_and_reductions, (jobs, str(root)), 2 if mesh == "2" else 4, root, lcfg)[0]
        return done[mesh]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", list(CASES))
def test_grad_norm_rides_the_steps_one_all_reduce(gradnorm_runs, mesh: str) -> None:
    """Under fully_shard (and HSDP, where only one replica's shards count) the grad norm's
    shares go into the all-reduce that carries the loss: the norm is torch's own, bit for bit,
    and a step issues one all-reduce besides FSDP's.
    Under replicate the norm is local and a step issues one all-reduce too (the loss)."""
    got = gradnorm_runs(mesh)
    for policy, (mode, rtol) in CASES[mesh].items():
        got_mode, ours, theirs, per_step = got[policy]
        assert got_mode == mode, policy
        assert ours == pytest.approx(theirs, rel=rtol, abs=0), policy
        assert per_step == 1, f"{policy}: {per_step} all-reduces a step besides FSDP's"


def test_grad_norm_rides_along_only_with_gradients_of_its_dtype_and_device(mesh) -> None:
    """Gradients of another dtype, or on another device than the step's all-reduce (CPU
    offload on a GPU), are reduced on their own; the norm comes back on the all-reduce's
    device either way, and equals torch's."""
    from composerun.parallel.gradnorm import GradNorm

    model, _ = build(mesh, torch.optim.AdamW, {})
    model(torch.randn(4, 8)).square().mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    theirs = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True).full_tensor()
    fused = GradNorm(params, torch.float32, torch.device("cpu"))
    assert fused.mode == "fused"
    shares = fused.shares()
    assert shares.shape == (len(params),)
    assert torch.equal(fused.total(shares), theirs)  # one rank: the all-reduce changes nothing
    for other in (GradNorm(params, torch.float64, torch.device("cpu")), GradNorm(params, torch.float32, "meta")):
        assert other.mode == "separate" and other.shares() is None
        got = other.total(None)
        assert got.device == other.device
        if got.device.type == "cpu":
            assert torch.equal(got, theirs)
    assert GradNorm([], torch.float32, "meta").total(None).device.type == "meta"


@pytest.mark.distributed
def test_grad_norm_over_every_mesh_a_policy_uses(tmp_path: Path) -> None:
    """Gradients on several meshes and placements at once (issue 19: HSDP children under a
    root over every rank crashed torch's norm with "All operands in aten.stack must have the
    same mesh"): each group is reduced over its own mesh's sharded dims, replicated copies
    counted once, and the norm, and the clipped gradients, are clip_grad_norm_'s on one rank
    holding the full gradients."""
    from fixtures.gradnorm import norm_over_meshes

    from composerun.launch.agent import start_ranks

    # its own launch: a second process group in ranks that ran composerun's (init_device_mesh's
    # new_group after a destroy) was seen to hang
    lcfg = LaunchConfig(start_method=StartMethod.forkserver)
    got = start_ranks(norm_over_meshes, (MAX_NORM,), 4, tmp_path, lcfg)[0]
    # flat, HSDP, replicated, a 2-rank sub-mesh, float64, plain, both dims sharded, a column split, HSDP again
    assert got["kinds"] == ["fused", "fused", "local", "separate", "separate", "local", "fused", "fused", "fused"]
    assert got["ours"] == pytest.approx(got["theirs"], rel=1e-6)
    assert got["ours"] > MAX_NORM  # so the clipping below did something
    assert got["clip_diff"] < 1e-6
