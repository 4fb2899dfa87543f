"""torch's composable-API registry, in process on one gloo rank.

- The contract composerun/_torch_compat/ relies on, pinned against the installed torch:
  which API names the registry reports, in which order, which state class backs them, and
  that no API renames a parameter or a state-dict key.
- _torch_compat/ is the only package of composerun that imports torch's private
  distributed modules, so a torch upgrade breaks in one place.
- Activation checkpointing really recomputes: a forward hook inside a
  checkpointed module fires twice per forward+backward, once without AC.
- `verify_units` reads the registry back and catches units torch does not show, and a
  parameter left outside every data-parallel unit; `assign_units` rejects bad rules by index.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import REPO, compose
from torch.distributed.fsdp import fully_shard

from composerun import _torch_compat as compat
from composerun.config.schema import RuleConfig, ShardingConfig
from composerun.config.typed import to_typed
from composerun.errors import ConfigError
from composerun.models import build_model
from composerun.models.reference import CompositeModel
from composerun.parallel import compile as compiling
from composerun.parallel.apply import apply_policy, apply_units, verify_units
from composerun.parallel.rules import assign_units

COMPOSITE = ("+model=composite", "model.dim=8")
TRANSFORMER = ("+model=transformer", "model.dim=16", "model.n_layers=4", "model.n_heads=2")


def composite(seed: int = 0) -> CompositeModel:
    torch.manual_seed(seed)
    return CompositeModel(dim=8)


def policy(*rules: dict[str, Any], require_coverage: bool = True) -> ShardingConfig:
    return to_typed({"name": "test", "rules": list(rules), "require_coverage": require_coverage}, ShardingConfig)


def typed(rules: list[dict[str, Any]]) -> list[RuleConfig]:
    """Rules as the config gives them: the schema's RuleConfig."""
    return [to_typed(r, RuleConfig) for r in rules]


def fqns(model: nn.Module) -> tuple[list[str], list[str]]:
    return [n for n, _ in model.named_parameters()], list(model.state_dict())


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


# --- 1. the contract of _torch_compat/ against the installed torch ---------------------------


def test_plain_module_has_no_api_and_no_state() -> None:
    m = composite()
    for _, sub in m.named_modules():
        assert compat.registered_apis(sub) == []
        assert compat.module_state_name(sub) is None


def test_fully_shard_registers_fsdp_state(mesh) -> None:
    m = composite()
    fully_shard(m.u1, mesh=mesh)
    assert compat.registered_apis(m.u1) == ["fully_shard"]
    assert compat.module_state_name(m.u1) == "FSDPState"
    # only the module it was applied to: not its children, parent or siblings
    for fqn in ("", "u1.l1", "u1.seq", "u2", "l1"):
        sub = m.get_submodule(fqn)
        assert compat.registered_apis(sub) == [], fqn
        assert compat.module_state_name(sub) is None, fqn


def test_replicate_registers_replicate(mesh) -> None:
    m = composite()
    compat.replicate(m, mesh=mesh)
    assert compat.registered_apis(m) == ["replicate"]
    assert compat.module_state_name(m) == "_ReplicateState"
    assert compat.registered_apis(m.u1) == []


def test_checkpoint_keeps_no_module_state_and_fully_shard_registers(mesh) -> None:
    """Activation checkpointing wraps the forward (no composable state, no registry entry);
    fully_shard on the same module registers as usual and keeps the wrapped forward."""
    m = composite()
    compiling.checkpoint_forward(m.u1, {"mode": "full"})
    assert compat.registered_apis(m.u1) == [] and compat.module_state_name(m.u1) is None
    assert compiling.checkpointed(m.u1) == "full"
    fully_shard(m.u1, mesh=mesh)
    assert compat.registered_apis(m.u1) == ["fully_shard"]
    assert compat.module_state_name(m.u1) == "FSDPState"
    assert compiling.checkpointed(m.u1) == "full"


def test_same_api_twice_is_refused_by_torch(mesh) -> None:
    m = composite()
    fully_shard(m.u1, mesh=mesh)
    with pytest.raises(AssertionError, match="only be applied to a module once"):
        fully_shard(m.u1, mesh=mesh)
    assert compat.registered_apis(m.u1) == ["fully_shard"]


@pytest.mark.parametrize("api", ["fully_shard", "replicate", "checkpoint", "checkpoint+fully_shard"])
def test_apis_keep_fqns_and_values(mesh, api: str) -> None:
    want_names, want_keys = fqns(composite(seed=1))
    want_sd = composite(seed=1).state_dict()
    m = composite(seed=1)
    if api == "fully_shard":
        fully_shard(m.u1, mesh=mesh)
        fully_shard(m, mesh=mesh)
    elif api == "replicate":
        compat.replicate(m, mesh=mesh)
    elif api == "checkpoint":
        compiling.checkpoint_forward(m.u1, {"mode": "full"})
        compiling.checkpoint_forward(m.u2, {"mode": "full"})
    else:
        compiling.checkpoint_forward(m.u1, {"mode": "full"})
        fully_shard(m.u1, mesh=mesh)
        fully_shard(m, mesh=mesh)
    assert fqns(m) == (want_names, want_keys)
    got_sd = m.state_dict()
    for k, v in want_sd.items():
        torch.testing.assert_close(full(got_sd[k]), v, rtol=0, atol=0, msg=k)


def test_missing_private_api_fails_with_one_clear_error() -> None:
    with pytest.raises(compat.ComposerunTorchCompatError, match=r"torch\.distributed\._composable_state\.nope"):
        compat._require("torch.distributed._composable_state", "nope")
    with pytest.raises(compat.ComposerunTorchCompatError, match=re.escape(torch.__version__)):
        compat._require("torch.distributed._no_such_module", "x")
    assert issubclass(compat.ComposerunTorchCompatError, ImportError)


# --- 2. private torch imports live in _torch_compat/ only ------------------------------------

_PRIVATE = re.compile(r"^torch\.(?:distributed(?:\.\w+)*\._\w*|testing\._internal)(?:\.\w+)*$")


def private_torch_imports(source: str) -> list[str]:
    """Private torch distributed/testing modules `source` imports, statically or by name."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hits += [a.name for a in node.names if _PRIVATE.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if _PRIVATE.match(node.module):
                hits.append(node.module)
            elif re.match(r"^torch\.(distributed|testing)\b", node.module):
                # `from torch.distributed.fsdp import _fully_shard`: a private submodule by name
                hits += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _PRIVATE.match(node.value):
            hits.append(node.value)  # importlib.import_module("torch.distributed._x") and the like
    # and any source line that imports one in a form the walk above does not see
    for line in source.splitlines():
        m = re.match(r"^\s*(?:from|import)\s+(torch\.(?:distributed\._|testing\._internal)[\w.]*)", line)
        if m and m.group(1) not in hits:
            hits.append(m.group(1))
    return hits


def test_private_import_detector_works() -> None:
    assert private_torch_imports("import torch.distributed._composable_state as s") == [
        "torch.distributed._composable_state"
    ]
    assert private_torch_imports("from torch.distributed._composable.contract import _get_registry") == [
        "torch.distributed._composable.contract"
    ]
    assert private_torch_imports("from torch.distributed.fsdp import _fully_shard") == [
        "torch.distributed.fsdp._fully_shard"
    ]
    assert private_torch_imports("from torch.testing._internal.common_dist_composable import UnitModule") == [
        "torch.testing._internal.common_dist_composable"
    ]
    assert private_torch_imports("m = importlib.import_module('torch.distributed._state_dict_utils')") == [
        "torch.distributed._state_dict_utils"
    ]
    public = "from torch.distributed.fsdp import fully_shard\nimport torch.distributed as dist\n"
    prose = '"""Same names as torch.testing._internal.common_dist_composable."""\n'
    assert private_torch_imports(public + prose) == []
    # the compat module itself is caught, so the scan below is not vacuous
    assert private_torch_imports((REPO / "composerun" / "_torch_compat" / "__init__.py").read_text())


def test_only_torch_compat_imports_private_torch_distributed() -> None:
    pkg = REPO / "composerun"
    files = sorted(pkg.rglob("*.py"))
    assert len(files) > 5 and pkg / "parallel" / "apply.py" in files
    offenders = {
        str(f.relative_to(REPO)): hits
        for f in files
        if "_torch_compat" not in f.relative_to(pkg).parts and (hits := private_torch_imports(f.read_text()))
    }
    assert not offenders, f"import these through composerun/_torch_compat/ instead: {offenders}"


# --- 3. activation checkpointing recomputes ---------------------------------------------------


def forward_calls(model: nn.Module, fqns_: list[str], inputs: torch.Tensor) -> dict[str, int]:
    """How often each module's forward runs during one forward+backward."""
    calls = dict.fromkeys(fqns_, 0)
    for fqn in fqns_:
        model.get_submodule(fqn).register_forward_hook(lambda *_, fqn=fqn: calls.__setitem__(fqn, calls[fqn] + 1))
    model(inputs).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    return calls


@pytest.mark.parametrize(("name", "want"), [("fsdp", 1), ("fsdp_ac", 2)])
def test_composite_ac_recomputes(mesh, name: str, want: int) -> None:
    cfg = compose(*COMPOSITE, f"sharding={name}")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    units = apply_policy(model, cfg.sharding, mesh)
    assert ("checkpoint" in units["u1"].apis) == (name == "fsdp_ac")
    assert compat.registered_apis(model.u1) == ["fully_shard"]
    assert compiling.checkpointed(model.u1) == ("full" if want == 2 else None)
    calls = forward_calls(model, ["u1.l1", "u2.seq.1"], torch.randn(4, 8))
    assert calls == {"u1.l1": want, "u2.seq.1": want}


@pytest.mark.parametrize(
    ("overrides", "recompute"),
    [((), {0, 2}), (("sharding.rules.0.every=1",), {0, 1, 2, 3})],
    ids=["every2", "every1"],
)
def test_transformer_ac_every_kth_block(mesh, overrides: tuple[str, ...], recompute: set[int]) -> None:
    cfg = compose(*TRANSFORMER, "sharding=fsdp_blocks_ac", *overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_policy(model, cfg.sharding, mesh)
    for i in range(4):
        assert compat.registered_apis(model.blocks[i]) == ["fully_shard"], i
        assert compiling.checkpointed(model.blocks[i]) == ("full" if i in recompute else None), i
    assert compat.registered_apis(model) == ["fully_shard"]
    names = [f"blocks.{i}.mlp.up" for i in range(4)] + ["head"]
    calls = forward_calls(model, names, torch.randint(0, 256, (2, 8)))
    assert calls == {**{f"blocks.{i}.mlp.up": 2 if i in recompute else 1 for i in range(4)}, "head": 1}


# --- 4. verify_units catches what the registry does not show -----------------------------------


def test_verify_units_passes_on_the_applied_plan(mesh) -> None:
    m = composite()
    rules = compose(*COMPOSITE, "sharding=fsdp_ac").sharding.rules
    units = assign_units(m, rules)
    apply_units(m, units, mesh)
    verify_units(m, units, rules, require_coverage=True)


def test_verify_units_catches_a_planned_api_not_applied(mesh) -> None:
    m = composite()
    rules = compose(*COMPOSITE, "sharding=fsdp").sharding.rules
    units = assign_units(m, rules)
    assert list(units) == ["l1", "u1", "u2", "l2", ""]
    for fqn in units:  # by hand, skipping u2
        if fqn != "u2":
            fully_shard(m.get_submodule(fqn), mesh=mesh)
    with pytest.raises(ConfigError, match=r"module 'u2': torch's registry shows no API .*sharding\.rules\[0\]"):
        verify_units(m, units, rules, require_coverage=False)


def test_verify_units_catches_an_unplanned_api(mesh) -> None:
    m = composite()
    rules = compose(*COMPOSITE, "sharding=fsdp").sharding.rules
    units = assign_units(m, rules)
    fully_shard(m.u1.l1, mesh=mesh)  # an extra unit the plan does not list
    apply_units(m, units, mesh)
    with pytest.raises(ConfigError, match=r"module 'u1\.l1': torch's registry shows \['fully_shard'\] but no rule"):
        verify_units(m, units, rules, require_coverage=True)


def test_verify_units_catches_a_missing_checkpoint(mesh) -> None:
    m = composite()
    rules = compose(*COMPOSITE, "sharding=fsdp_ac").sharding.rules
    units = assign_units(m, rules)
    without_ac = assign_units(m, rules[1:])
    apply_units(m, without_ac, mesh)
    with pytest.raises(ConfigError, match=r"module 'l1': sharding\.rules\[0\].* planned activation checkpointing full, and its forward has none"):
        verify_units(m, units, rules, require_coverage=True)


def test_require_coverage_catches_an_uncovered_parameter(mesh) -> None:
    m = composite()
    with pytest.raises(ConfigError, match=r"parameter 'u1\.l1\.weight' is in no fully_shard/replicate unit"):
        apply_policy(m, policy({"match": "l1", "api": "fully_shard"}), mesh)


def test_checkpoint_does_not_count_as_coverage(mesh) -> None:
    m = composite()
    rules = ({"match": "*", "api": "checkpoint"}, {"match": "l1", "api": "fully_shard"})
    with pytest.raises(ConfigError, match=r"parameter 'u1\.l1\.weight' is in no fully_shard/replicate unit"):
        apply_policy(m, policy(*rules), mesh)


def test_require_coverage_false_allows_partial_units(mesh) -> None:
    m = composite()
    units = apply_policy(m, policy({"match": "l1", "api": "fully_shard"}, require_coverage=False), mesh)
    assert {f: u.apis for f, u in units.items()} == {"l1": ["fully_shard"]}
    assert compat.registered_apis(m.l1) == ["fully_shard"] and compat.registered_apis(m) == []


# --- 5. assign_units rejects bad rules, naming the rule --------------------------------------------


def test_glob_matching_nothing() -> None:
    with pytest.raises(ConfigError, match=r"sharding\.rules\[0\] \(match='nope\.\*'\) matches no module") as e:
        assign_units(composite(), typed([{"match": "nope.*", "api": "fully_shard"}]))
    assert "['l1', 'u1', 'u2', 'l2']" in str(e.value)  # the top-level modules, to pick from


def test_glob_matching_only_modules_without_parameters() -> None:
    with pytest.raises(ConfigError, match=r"sharding\.rules\[1\] \(match='u1\.seq\.0'\) matches no module"):
        assign_units(
            composite(), typed([{"match": "*", "api": "fully_shard"}, {"match": "u1.seq.0", "api": "checkpoint"}])
        )


def test_unknown_class_name() -> None:
    with pytest.raises(ConfigError, match=r"sharding\.rules\[0\] \(class_name='Nope'\).*no module of class 'Nope'"):
        assign_units(composite(), typed([{"class_name": "Nope", "api": "fully_shard"}]))


def test_same_api_twice_on_one_module() -> None:
    rules = [{"match": "u1", "api": "fully_shard"}, {"match": "*", "api": "fully_shard"}]
    with pytest.raises(
        ConfigError,
        match=r"sharding\.rules\[1\] \(match='\*'\): module 'u1' is already given fully_shard by sharding\.rules\[0\]",
    ):
        assign_units(composite(), typed(rules))


def test_fully_shard_and_replicate_on_one_module() -> None:
    rules = [{"match": "<root>", "api": "replicate"}, {"match": "<root>", "api": "fully_shard"}]
    with pytest.raises(
        ConfigError, match=r"sharding\.rules\[1\] .*module '<root>' already has replicate; one data-parallel API"
    ):
        assign_units(composite(), typed(rules))


def test_dp_conflict_names_the_dp_api_after_a_checkpoint_rule() -> None:
    rules = [
        {"match": "u1", "api": "checkpoint"},
        {"match": "u1", "api": "fully_shard"},
        {"match": "u1", "api": "replicate"},
    ]
    with pytest.raises(ConfigError, match=r"sharding\.rules\[2\] .*module 'u1' already has fully_shard"):
        assign_units(composite(), typed(rules))


def test_class_name_selects_unit_modules() -> None:
    units = assign_units(composite(), typed([{"class_name": "UnitModule", "api": "fully_shard"}]))
    assert {f: (u.cls, u.apis, u.rules) for f, u in units.items()} == {
        "u1": ("UnitModule", ["fully_shard"], [0]),
        "u2": ("UnitModule", ["fully_shard"], [0]),
    }


def test_plan_order_children_first_checkpoint_first() -> None:
    rules = compose(*COMPOSITE, "sharding=fsdp_ac").sharding.rules
    units = assign_units(composite(), rules)
    assert list(units) == ["l1", "u1", "u2", "l2", ""]
    assert all(units[f].apis == ["checkpoint", "fully_shard"] for f in ("l1", "u1", "u2", "l2"))
    assert units[""].apis == ["fully_shard"] and units[""].rules == [2]


def test_no_process_group_left_behind() -> None:
    assert not dist.is_initialized()


def test_the_rendezvous_names_its_events_as_torch_does_without_reading_the_stack(monkeypatch) -> None:
    """quiet_rendezvous_names swaps torch's get_method_name (inspect.stack() twice a call) for a
    frame read: the same name at every depth, the same fallback past the stack's top, and no
    inspect.stack() call."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    torchs = rdzv.get_method_name
    monkeypatch.setattr(rdzv, "get_method_name", torchs)  # put back after the test

    def named(getter, depth):
        def the_caller():
            return the_callee()

        def the_callee():
            return getter(depth) if depth is not None else getter()

        return the_caller()

    depths = [None, 0, 1, 2, 3, 10_000]
    expected = [named(torchs, d) for d in depths]
    assert expected[:5] == ["the_caller", "get_method_name", "the_callee", "the_caller", "named"]
    assert expected[5] == "no_method_name"
    compat.quiet_rendezvous_names()
    compat.quiet_rendezvous_names()  # idempotent
    ours = rdzv.get_method_name
    assert ours is not torchs
    stacks = []
    monkeypatch.setattr(inspect, "stack", lambda *a, **k: stacks.append(1) or [])
    assert [named(ours, d) for d in depths] == expected
    assert not stacks


GLOO_DUMP = """
import sys
from pathlib import Path
import torch, torch.distributed as dist
from composerun import _torch_compat as compat
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(2))
import pickle
dump = pickle.loads(compat.flight_recorder_dump(False))
for group in dump["pg_config"].values():
    group["ranks"] = "[0, 1]"  # as if a second rank, which never started the last all-reduce
(Path(sys.argv[1]) / "rank_0").write_bytes(pickle.dumps(dump))
dump["entries"] = dump["entries"][:-1]
(Path(sys.argv[1]) / "rank_1").write_bytes(pickle.dumps(dump))
from torch.distributed.flight_recorder.fr_trace import main
try:
    main([sys.argv[1]])
except AssertionError as e:
    print("refused:", e)
else:
    print("read")
"""


def test_the_flight_recorder_analyzer_reads_gloo_dumps_where_compat_says(tmp_path) -> None:
    """Two gloo ranks' dumps as composerun writes them (the group table filled in; the second
    rank's made from the first's, one all-reduce behind): torch's own analyzer matches them on
    the torch where `analyzer_reads_gloo` says so, and refuses them (2.11) where not; so the
    timeout line points at the analyzer only where it works."""
    import os
    import subprocess
    import sys

    from composerun import _torch_compat as compat

    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "10", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", GLOO_DUMP, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout.strip().splitlines()[-1]
    assert said == "read" if compat.analyzer_reads_gloo() else said.startswith("refused:"), said
