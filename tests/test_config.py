"""Pure tier: config composition, validation, the CLI's argument and error handling,
the LR schedule and the data's determinism."""

from __future__ import annotations

import functools
import itertools
import os

import pytest
import torch
from conftest import REPO, compose, compose_node
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from composerun.cli import format_config_error, quote_mesh_choices
from composerun.config import validate as validate_config
from composerun.config import world_size_of
from composerun.config.schema import Config, OptimConfig, Schedule, Task
from composerun.config.typed import to_plain, to_typed
from composerun.data import SyntheticData, meta_batch
from composerun.errors import ConfigError
from composerun.launch.job import _model_options
from composerun.train.optim import lr_factor

GROUPS = ["model", "mesh", "sharding", "optim", "data", "checkpoint"]
OPTIONS = [
    (group, p.stem)
    for group in GROUPS
    for p in sorted((REPO / "composerun" / "configs" / group).glob("*.yaml"))
    if not p.stem.startswith("_")
]
MESH_SHAPES = {"1": [1], "2": [2], "4": [4], "8": [8], "2x2": [2, 2], "2x4": [2, 4], "4x2": [4, 2], "2x2x2": [2, 2, 2]}


@functools.lru_cache(maxsize=1)
def _base_yaml() -> str:
    return OmegaConf.to_yaml(compose_node("+model=composite"), resolve=True)


def _base():
    """A valid composed config (composite model, defaults elsewhere), fresh on each call."""
    return OmegaConf.create(_base_yaml())


def _contains(expected, actual, where: str) -> None:
    """Every value the yaml sets (interpolations aside) is in the composed config."""
    if isinstance(expected, dict):
        for k, v in expected.items():
            assert k in actual, f"{where}.{k} missing"
            _contains(v, actual[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _contains(e, a, f"{where}[{i}]")
    elif not (isinstance(expected, str) and "${" in expected):
        assert actual == expected, where


# --- every shipped option composes ---------------------------------------------------


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_composes_and_validates(group, option):
    """`group=option` for every shipped yaml composes, validates, and carries the yaml's values."""
    if group == "model":
        cfg = compose(f"+model={option}")
    else:
        cfg = compose("+model=composite", f"{group}={option}")
    own = OmegaConf.to_container(OmegaConf.load(REPO / "composerun" / "configs" / group / f"{option}.yaml"))
    own.pop("defaults", None)
    _contains(own, to_plain(getattr(cfg, group)), group)
    if group == "mesh":
        assert cfg.mesh.shape == MESH_SHAPES[option]


def test_shipped_mesh_options_are_the_documented_ones():
    """The mesh group ships exactly the documented shapes (a missing yaml would skip its test above)."""
    assert sorted(o for g, o in OPTIONS if g == "mesh") == sorted(MESH_SHAPES)


def test_any_mesh_shape_by_key():
    """`mesh.shape=[3,2]` gives a mesh with no shipped option."""
    cfg = compose("+model=composite", "mesh.shape=[3,2]", "data.batch_size=12")
    assert cfg.mesh.shape == [3, 2]
    assert world_size_of(cfg.mesh.shape) == 6


# --- the CLI's argument quoting ------------------------------------------------------


@pytest.mark.parametrize(
    "arg,quoted",
    [
        ("mesh=2", "mesh='2'"),
        ("mesh=8", "mesh='8'"),
        ("mesh=1,2,2x2", "mesh='1','2',2x2"),
        ("mesh=2x4", "mesh=2x4"),
        ("+mesh=2", "+mesh='2'"),
        ("++mesh=4", "++mesh='4'"),
        ("mesh.shape=[2,2]", "mesh.shape=[2,2]"),
        ("train.steps=2", "train.steps=2"),
        ("+model=composite", "+model=composite"),
        ("hydra.run.dir=mesh=2", "hydra.run.dir=mesh=2"),
    ],
)
def test_quote_mesh_choices(arg, quoted):
    """`mesh=2` and sweeps of numeric meshes reach Hydra as strings; nothing else changes."""
    assert quote_mesh_choices(["+model=unit", arg]) == ["+model=unit", quoted]


# --- compose-time errors name the key ------------------------------------------------


@pytest.mark.parametrize(
    "override,key",
    [
        ("trian.steps=3", "trian"),
        ("optim.lr=abc", "optim.lr"),
        ("mesh.device=tpu", "mesh.device"),
        ("train.steps=1.5", "train.steps"),
        ("checkpoint.async=maybe", "checkpoint.async"),
    ],
)
def test_compose_error_is_one_line_naming_the_key(override, key):
    """A misspelt key, wrong type or bad enum fails at compose time, reported in one line naming the key."""
    with pytest.raises(ConfigCompositionException) as exc:
        compose("+model=composite", override)
    line = format_config_error(exc.value)
    assert line is not None and "\n" not in line
    assert key in line


@pytest.mark.parametrize(
    "override,line",
    [
        ("+train.stepz=2", "train.stepz: no such key in train; did you mean train.steps?"),
        ("+optim.lrr=5", "optim.lrr: no such key in optim; did you mean optim.lr?"),
        ("+sharding.rules.0.mathc=l1", "sharding.rules.0.mathc: no such key in sharding.rules.0; did you mean sharding.rules.0.match?"),
        ("+model.depth=3", "model.depth: no such key in model; a constructor argument goes under model.kwargs: +model.kwargs.depth=..."),
        ("+foo=1", "foo: no such key in the config; the config has: adapter, checkpoint, compile, data, eval, launch, mesh, metrics, model, optim, plan, profile, sharding, train"),
    ],
)  # fmt: skip
def test_a_key_added_with_plus_must_exist(override, line):
    """`+KEY=V` adds a key Hydra's schema check lets through, and nothing would read it."""
    with pytest.raises(ConfigError) as exc:
        compose("+model=composite", override)
    assert str(exc.value) == line


@pytest.mark.parametrize(
    "override,line",
    [
        ("train.step=5", "train.step: no such key in train; did you mean train.steps?"),
        ("sharding.rules.0.evry=2", "sharding.rules.0.evry: no such key in sharding.rules.0; did you mean sharding.rules.0.every?"),
        ("checkpoint.asinc=true", "checkpoint.asinc: no such key in checkpoint; did you mean checkpoint.async?"),
        ("model.depth=3", "model.depth: no such key in model; a constructor argument goes under model.kwargs: +model.kwargs.depth=..."),
        ("trian.steps=3", "trian: no such key in the config; did you mean train?"),
    ],
)  # fmt: skip
def test_a_misspelt_key_gets_the_nearest_real_one(override, line):
    """Without `+` Hydra refuses the key itself; the line says which key was meant, as for `+KEY`."""
    with pytest.raises(ConfigCompositionException) as exc:
        compose("+model=composite", override)
    assert format_config_error(exc.value) == line


def test_kwargs_take_any_key():
    assert compose("+model=composite", "+model.kwargs.bias=false", "+optim.kwargs.amsgrad=true", validate=True)


@pytest.mark.parametrize("override,group", [("mesh=3", "mesh"), ("+model=nope", "model")])
def test_unknown_option_lists_the_real_choices(override, group):
    """An unknown group option names the group and lists the shipped options, not Hydra's `_schema`."""
    with pytest.raises(ConfigCompositionException) as exc:
        compose("+model=composite" if group != "model" else "train.steps=1", override)
    line = format_config_error(exc.value)
    assert line.startswith(f"unknown {group} ") and "\n" not in line
    assert "_schema" not in line
    assert all(o in line for g, o in OPTIONS if g == group)


def test_format_config_error_ignores_other_exceptions():
    """Errors that are not config errors are left for the caller to raise (None)."""
    assert format_config_error(RuntimeError("boom")) is None


# --- validate(): cross-field checks --------------------------------------------------


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["train.steps=-1"], "train.steps"),
        (["optim.grad_clip=-1"], "optim.grad_clip"),
        (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio"),
        (["optim.min_lr_ratio=-0.1"], "optim.min_lr_ratio"),
        (["launch.monitor_interval=-1"], "launch.monitor_interval"),
        (["sharding.rules=[{match: l1}]"], "sharding.rules.0"),
        (["mesh.shape=[0,2]"], "mesh.shape"),
        (["mesh.shape=[2,2]", "data.batch_size=6"], "data.batch_size"),
        (["optim.lr=0"], "optim.lr"),
        (["checkpoint.keep=0"], "checkpoint.keep"),
        (["checkpoint.resume=/no/such/path"], "checkpoint.resume"),
        (["checkpoint.resume=" + __file__], "checkpoint.resume"),  # a file, not a checkpoint folder
        (["model.dim=-4"], "model.dim"),
        (["checkpoint.init_from=" + __file__.rsplit("/", 1)[0]], "checkpoint.init_from"),  # a folder
        (["model.dim=0"], "model.dim"),
        (["model.n_heads=0"], "model.n_heads"),
        (["launch.omp_threads=-3"], "launch.omp_threads=-3"),  # (else a rank fails setting it)
        (["train.steps=${nosuch}"], "train.steps=${nosuch}: Interpolation key 'nosuch' not found"),
    ],
)
def test_validate_rejects_bad_values_naming_the_key(overrides, key):
    """Values that type-check but cannot run are rejected before launch, naming the key."""
    cfg = OmegaConf.merge(_base(), OmegaConf.from_dotlist(overrides))
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    assert key in str(exc.value) and "\n" not in str(exc.value)


def test_ranks_get_the_schema_dataclasses():
    """What the ranks receive is typed: the schema's dataclasses and enums (a misspelt field is an
    AttributeError where it is read), and its plain form is the resolved YAML, key for key."""
    node = compose_node("+model=fusion_embedding", "checkpoint.async=true", "+optim.kwargs.amsgrad=true")
    cfg = to_typed(node)
    assert isinstance(cfg, Config) and cfg.model.task is Task.tokens and cfg.optim.schedule is Schedule.cosine
    assert cfg.model.task == "tokens" and f"{cfg.model.task}" == "tokens"  # a user's data class may compare strings
    assert cfg.checkpoint.async_ is True and cfg.optim.kwargs["amsgrad"] is True
    with pytest.raises(AttributeError, match="stepz"):
        cfg.train.stepz  # noqa: B018
    assert to_plain(cfg) == OmegaConf.to_container(node, resolve=True, enum_to_str=True)


def test_compose_runs_validate():
    """The composed config a rank receives has passed validate(): a bad value fails at compose."""
    with pytest.raises(ConfigError, match="train.steps"):
        compose("+model=composite", "train.steps=-1")


def test_validate_without_model_lists_the_models():
    """With no +model, the error lists every shipped model and no internal `_schema`."""
    cfg = compose_node(validate=False)
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg, _model_options())
    msg = str(exc.value)
    assert "+model=" in msg and "_schema" not in msg
    assert all(o in msg for g, o in OPTIONS if g == "model")


def test_validate_accepts_divisible_batch_on_2d_mesh():
    """A global batch divisible by the mesh's world size is accepted (the check is not over-strict)."""
    cfg = OmegaConf.merge(_base(), OmegaConf.from_dotlist(["mesh.shape=[2,2]", "data.batch_size=12"]))
    validate_config(cfg)


# --- LR schedule ---------------------------------------------------------------------


def _optim(**changes) -> OptimConfig:
    return to_typed({**OmegaConf.to_container(_base().optim), **changes}, OptimConfig)


def test_warmup_rises_linearly_to_the_full_lr():
    """During warmup the LR rises in equal steps, reaching the full LR when warmup ends."""
    ocfg = _optim(warmup_steps=4)
    f = [lr_factor(s, 20, ocfg) for s in range(5)]
    steps = [b - a for a, b in itertools.pairwise(f)]
    assert all(d > 0 for d in steps) and max(steps) - min(steps) < 1e-12
    assert f[0] > 0 and f[4] == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_ends_at_min_lr_ratio(schedule):
    """After warmup the LR decays monotonically to optim.min_lr_ratio x optim.lr, reached at
    the last step (index total - 1)."""
    ocfg = _optim(warmup_steps=2, schedule=schedule, min_lr_ratio=0.25)
    total = 21
    f = [lr_factor(s, total, ocfg) for s in range(2, total)]
    assert f[0] == pytest.approx(1.0)
    assert all(b < a for a, b in itertools.pairwise(f))
    assert f[-1] == 0.25
    mid = lr_factor(2 + 9, total, ocfg)  # halfway through the decay: steps 2..20
    assert mid == pytest.approx(0.25 + 0.75 * 0.5)


def test_constant_schedule_is_one():
    """optim=sgd's constant schedule keeps the configured LR at every step."""
    ocfg = compose("+model=unit", "optim=sgd").optim
    assert ocfg.schedule == Schedule.constant and ocfg.warmup_steps == 0
    assert [lr_factor(s, 10, ocfg) for s in range(11)] == [1.0] * 11


# --- data determinism ----------------------------------------------------------------


@pytest.mark.parametrize("model", ["composite", "fusion_embedding"])
def test_global_batch_is_the_same_however_split(model):
    """Samples are indexed globally: one rank's batch equals two ranks' halves, and seeds matter."""
    cfg = compose(f"+model={model}")
    data = SyntheticData(cfg.model, seed=cfg.data.seed)
    x, y = data.batch(range(0, 8))
    (x1, y1), (x2, y2) = data.batch(range(0, 4)), data.batch(range(4, 8))
    assert torch.equal(x, torch.cat([x1, x2])) and torch.equal(y, torch.cat([y1, y2]))
    assert not torch.equal(x1, x2)  # distinct samples, not one repeated
    again = SyntheticData(cfg.model, seed=cfg.data.seed)  # another rank, a resumed run
    assert torch.equal(again.batch(range(4, 8))[1], y2)
    other = SyntheticData(cfg.model, seed=cfg.data.seed + 1)
    assert not torch.equal(other.batch(range(0, 8))[0], x)


@pytest.mark.parametrize("task", ["regression", "tokens"])
def test_the_launchers_checks_build_no_data_of_the_models_size(task):
    """The launcher builds the data source and reads a batch on the meta device: a synthetic
    source's map (in_dim x out_dim: 160 GB at model.dim=200000) is made by the ranks only."""
    big = ["model.dim=200000"] if task == "regression" else ["model.task=tokens", "model.vocab_size=10000000000"]
    data = SyntheticData(compose("+model=unit", *big).model, seed=0)
    x, y = meta_batch(data, 4)
    assert x.is_meta and y.is_meta and x.shape[0] == y.shape[0] == 4
    assert all(t.is_meta for rule in data._rules.values() for t in rule)


# --- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "device", "on"),
    [(None, "cpu", True), (None, "cuda", False), (True, "cuda", True), (False, "cpu", False), (True, "cpu", True)],
)
def test_train_deterministic_default_is_on_for_cpu_only_and_never_fills_memory(monkeypatch, given, device, on):
    """train.deterministic=null: torch's deterministic algorithms on a CPU mesh, off on GPUs;
    never torch's filling of new memory (a quarter of a CPU step); true on GPUs sets cuBLAS's
    deterministic workspace."""
    from composerun.train.run import set_determinism

    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        assert set_determinism(given, torch.device(device)) is on
        assert torch.are_deterministic_algorithms_enabled() is on
        assert torch.utils.deterministic.fill_uninitialized_memory is False
        assert ("CUBLAS_WORKSPACE_CONFIG" in os.environ) == (on and device == "cuda")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
