"""An independent oracle: composerun's training against a plain torch loop written here.

The parity matrix (tests/test_policies.py) compares composerun with composerun on one rank,
so a bug both sides share passes it: an LR schedule that ignores warmup and decay, a clip
that never clips, batches taken in another order.  Here cells of the policy matrix (meshes
1, 2 and 2x2; no API, fully_shard, HSDP, replicate, fully_shard per block with activation
checkpointing; gradient accumulation in one cell) train 10 fp32 steps, and a one-process
loop in this file trains the same model from the same initial weights with nothing of
composerun's training code: torch.optim.AdamW with the same hyper-parameters, its own
warmup-then-decay schedule (`lr_at`, the schedule as specified), torch.nn.utils.clip_grad_norm_,
its own loss (the mean over the global batch) and its own batches: step s takes samples
[s*B, (s+1)*B) of the data source.  What sample i is (the data source's `batch(indices)`)
and the model's architecture are shared; everything a training loop decides is not.  Per
step the LR, the loss and the gradient norm are compared, and at the end the weights and
Adam's moments.

The learning rate is high enough that the schedule moves the weights far, and the clip
value is below every step's gradient norm, so clipping acts at every step.  The test checks
both about its own runs (`test_the_oracle_would_see_the_planted_bugs`), so it cannot quietly
lose its power when a default changes.

The initial weights come from composerun, not from its init code: a run of one step at
lr 0 (AdamW's update and its decoupled decay are both multiplied by the LR, so the weights
it saves are the ones it started from).  The oracle thus keeps working however composerun
initializes (on the meta device or not), and each cell's first loss, computed on its own
initial weights, equal to the oracle's says every mesh starts from one rank's weights.

bf16 parameters are held to a bound derived from bf16's precision (`bf16_bound`), not to a
percentage.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import choose_start, compose, latest_checkpoint, read_metrics
from fixtures.matrix import train_all
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from composerun.config import world_size_of
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.data import SyntheticData
from composerun.launch.agent import launch, start_ranks
from composerun.models import build_model

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP loads with no group
]

STEPS = 10
LR, WARMUP, MIN_LR_RATIO, WEIGHT_DECAY = 3e-2, 3, 0.1, 0.1
CLIP = 0.05  # every step's gradient norm in these runs is over twice this (checked)
OPTIM = [
    f"optim.lr={LR}",
    f"optim.warmup_steps={WARMUP}",
    f"optim.min_lr_ratio={MIN_LR_RATIO}",
    f"optim.weight_decay={WEIGHT_DECAY}",
    f"optim.grad_clip={CLIP}",
]
MODELS = {
    "composite": ["+model=composite", "model.dim=16", "data.batch_size=8"],
    "transformer": ["+model=transformer", "model.dim=32", "model.n_layers=2", "model.seq_len=8", "data.batch_size=8"],
}
# cell -> (mesh, model, overrides)
CELLS: dict[str, tuple[str, str, list[str]]] = {
    "composite-none": ("1", "composite", ["sharding=none"]),
    "composite-fsdp-accum2": ("2", "composite", ["sharding=fsdp", "train.grad_accum=2"]),
    "composite-ddp-linear": ("2", "composite", ["sharding=ddp", "optim.schedule=linear"]),
    "transformer-fsdp_blocks": ("2", "transformer", ["sharding=fsdp_blocks"]),
    "composite-hsdp": ("2x2", "composite", ["sharding=hsdp"]),
    "transformer-fsdp_blocks_ac": ("2x2", "transformer", ["sharding=fsdp_blocks_ac"]),
}
# bf16 parameters, fp32 gradient reduction: against the fp32 oracle (test_bf16_...)
BF16 = ("2", "composite", ["sharding=fsdp", "sharding.param_dtype=bfloat16", "sharding.reduce_dtype=float32"])
# fp32 on up to 4 ranks against one process: a step's sums are added in other orders, and
# Adam carries those last-bit differences on.  Measured: losses and gradient norms within
# 2.3e-7 relative; weights and Adam's moments within 7.4e-6 of each tensor's largest value
# (the most in the transformer's MLP and embedding, where Adam divides gradients that nearly
# cancel by their own size).  A planted bug moves some tensor by 0.18 of its largest value
# or more (test_the_oracle_would_see_the_planted_bugs).
RTOL_STEP, RTOL_FINAL = 1e-5, 1e-4
BF16_ROUNDING = 2.0**-8  # bf16 keeps 8 significant bits: rounding to nearest is off by at most 2^-8


def cell_overrides(model: str, mesh: str, *extra: str) -> list[str]:
    return [*MODELS[model], f"mesh={mesh}", f"train.steps={STEPS}", *OPTIM, "metrics.progress=false", *extra]


def init_overrides(model: str) -> list[str]:
    # lr 0 is refused by composerun's checks (rightly: a user's run would not train), so this
    # one config is composed without them
    return [*MODELS[model], "mesh=1", "sharding=none", "train.steps=1", "optim.lr=0", "metrics.progress=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every cell's run dir (named after the cell) and each model's initial weights
    (`init-MODEL`) under one root: one launch of ranks per mesh, its cells in turn; mesh 1's
    in this process, as composerun's launcher runs one rank."""
    root = tmp_path_factory.mktemp("oracle")
    by_mesh: dict[str, dict[str, Any]] = {"1": {}}
    for model in MODELS:
        by_mesh["1"][f"init-{model}"] = compose(*init_overrides(model), validate=False)
    for name, (mesh, model, extra) in {**CELLS, "composite-fsdp-bf16": BF16}.items():
        by_mesh.setdefault(mesh, {})[name] = compose(*cell_overrides(model, mesh, *extra))
    for name, cfg in by_mesh.pop("1").items():
        (root / name).mkdir()
        launch(cfg, root / name, 1, choose_start(cfg, root / name))
    for cells in by_mesh.values():
        jobs = list(cells.items())
        world = world_size_of(jobs[0][1].mesh.shape)
        start_ranks(train_all, (jobs, str(root)), world, root, LaunchConfig(start_method=StartMethod.forkserver))
    return root


def read_checkpoint(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint by its stored key (`model.FQN`,
    `optim.state.FQN.exp_avg`, ...), read with DCP alone: no model, no composerun code."""
    ckpt = str(latest_checkpoint(run))
    meta = FileSystemReader(ckpt).read_metadata()
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and k.startswith(("model.", "optim.state."))
    }
    dcp.load(sd, checkpoint_id=ckpt)
    return sd


def lr_at(step: int, steps: int, schedule: str) -> float:
    """The schedule as specified: linear warmup over WARMUP steps, then a cosine or linear
    decay from LR at step WARMUP to exactly LR * MIN_LR_RATIO at the last step (steps from 0)."""
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    frac = (step - WARMUP) / max(1, steps - 1 - WARMUP)
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * shape)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean over the global batch: squared error for regression, cross-entropy per token."""
    if target.dtype.is_floating_point:
        return F.mse_loss(out, target)
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def oracle(overrides: list[str], init: dict[str, torch.Tensor], **bug: Any) -> dict[str, Any]:
    """The run of `overrides` in one process with plain torch, from `init`.  `bug` plants a
    mistake into the oracle itself, to show the comparison would see it: constant_lr,
    lr_scale=k, no_clip, shift=k (every step's batch k batches on)."""
    cfg = compose(*overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only cost, more so on a busy machine
    try:
        return _train_plainly(cfg, init, bug)
    finally:
        torch.set_num_threads(threads)


def _train_plainly(cfg: Any, init: dict[str, torch.Tensor], bug: dict[str, Any]) -> dict[str, Any]:
    model = build_model(cfg.model)  # the architecture: every value comes from `init`
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    model.load_state_dict({k.removeprefix("model."): v for k, v in init.items() if k.startswith("model.")})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    data, batch = SyntheticData(cfg.model, seed=cfg.data.seed), cfg.data.batch_size
    out: dict[str, Any] = {"loss": [], "grad_norm": [], "lr": []}
    for s in range(STEPS):
        lr = LR if bug.get("constant_lr") else lr_at(s, STEPS, cfg.optim.schedule.value) * bug.get("lr_scale", 1)
        for group in opt.param_groups:
            group["lr"] = lr
        first = (s + bug.get("shift", 0)) * batch
        x, y = data.batch(range(first, first + batch))
        loss = loss_of(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf if bug.get("no_clip") else CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
        out["lr"].append(lr)
    names = {id(p): n for n, p in model.named_parameters()}
    out["final"] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out["final"][f"optim.state.{names[id(p)]}.{k}"] = st[k].clone()
    return out


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |got - want| relative to the largest |want| of the same tensor, over
    `want`'s tensors (weights, and Adam's moments, whose values are orders of magnitude
    smaller), and which tensor."""
    assert set(want) <= set(got), f"missing from the checkpoint: {sorted(set(want) - set(got))}"
    return max(
        ((got[k].double() - w.double()).abs().max().item() / max(w.abs().max().item(), 1e-30), k)
        for k, w in want.items()
        if w.numel()
    )


def oracle_of(runs: Path, cell: tuple[str, str, list[str]], **bug: Any) -> dict[str, Any]:
    mesh, model, extra = cell
    return oracle(cell_overrides(model, mesh, *extra), read_checkpoint(runs / f"init-{model}"), **bug)


@pytest.fixture(scope="module")
def oracles(runs: Path) -> dict[str, dict[str, Any]]:
    return {name: oracle_of(runs, cell) for name, cell in CELLS.items()}


@pytest.mark.parametrize("name", list(CELLS))
def test_composerun_matches_the_plain_torch_oracle(runs: Path, oracles: dict[str, Any], name: str) -> None:
    """Every step's LR, loss and gradient norm (before clipping), then the final weights and
    Adam's moments, are the oracle's."""
    want = oracles[name]
    assert min(want["grad_norm"]) > 2 * CLIP, f"{name}: clipping must act at every step"
    rows = read_metrics(runs / name)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for what, rtol in (("lr", 1e-12), ("loss", RTOL_STEP), ("grad_norm", RTOL_STEP)):
        got = [r[what] for r in rows]
        bad = [
            f"step {s + 1}: {g:.7g} vs {w:.7g}"
            for s, (g, w) in enumerate(zip(got, want[what], strict=True))
            if g != pytest.approx(w, rel=rtol)
        ]
        assert not bad, f"{name}: {what} differs from the oracle's at {len(bad)} steps: " + "; ".join(bad[:3])
    diff, where = max_diff(read_checkpoint(runs / name), want["final"])
    assert diff <= RTOL_FINAL, f"{name}: the final {where} differs from the oracle's by {diff:.3g} of its largest value"


def test_the_oracle_would_see_the_planted_bugs(runs: Path, oracles: dict[str, Any]) -> None:
    """These runs are strong enough to tell a wrong schedule, a clip that never clips and
    batches off by one from the right training: each, planted into the oracle, ends with
    weights or moments far outside the tolerance."""
    for name in ("composite-none", "transformer-fsdp_blocks"):
        for bug in ({"constant_lr": True}, {"no_clip": True}, {"shift": 1}):
            diff, where = max_diff(oracle_of(runs, CELLS[name], **bug)["final"], oracles[name]["final"])
            assert diff > 100 * RTOL_FINAL, f"{name}, planted {bug}: {where} moved only {diff:.3g} of its largest value"


def bf16_bound(fp32: list[float]) -> list[float]:
    """How far a bf16 run's loss may be from the fp32 run's at each step: one bf16 rounding
    (2^-8 relative) of the loss itself, plus one of every step's change of the loss so far
    (each update is computed from bf16 weights and activations, so the change of the loss it
    causes is known to about one rounding; the errors add up over the steps).  Measured here
    the bf16 run stays within 0.16 of this; a run at a quarter of the LR is 15x outside it at
    its second step, and a run that does not learn further still."""
    moved = [0.0] + [abs(b - a) for a, b in zip(fp32, fp32[1:], strict=False)]
    return [BF16_ROUNDING * (loss + sum(moved[: s + 1])) for s, loss in enumerate(fp32)]


def test_bf16_stays_within_bf16_rounding_of_the_fp32_oracle(runs: Path) -> None:
    """bf16 parameters (fp32 reduce) on 2 ranks, step by step against the fp32 oracle."""
    fp32 = oracle_of(runs, BF16)["loss"]
    bound = bf16_bound(fp32)
    bf16 = [r["loss"] for r in read_metrics(runs / "composite-fsdp-bf16")]
    assert len(bf16) == STEPS
    off = [
        f"step {s + 1}: |{b:.6g} - {f:.6g}| > {m:.3g}"
        for s, (b, f, m) in enumerate(zip(bf16, fp32, bound, strict=True))
        if not abs(b - f) <= m
    ]
    assert not off, f"bf16 left the bound of bf16's rounding around fp32 at {len(off)} steps: " + "; ".join(off[:3])
    assert max(abs(b - f) / f for b, f in zip(bf16, fp32, strict=True)) > 1e-6, (
        "bf16 did not run: the losses are fp32's"
    )
    # the bound is tight enough to see a run that learns four times slower, or not at all
    for scale in (0.25, 0.0):
        slow = oracle_of(runs, BF16, lr_scale=scale)["loss"]
        worst = max(abs(q - f) / m for q, f, m in zip(slow, fp32, bound, strict=True))
        assert worst > 5, f"a run at lr x{scale} stays within {worst:.2g} of the bf16 bound"
