"""Sharding policies end to end: a user's own model and policy through the CLI, text data, the GPU
recipe's bf16 and selective AC on the CPU (its training on gloo ranks, its plan=true as typed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, cli, read_metrics, train

# A bad policy (an unknown api, a glob or a class that matches nothing, an api given twice, a
# mesh dim the mesh lacks, HSDP on a 1-D mesh, no data-parallel rule, an unknown rule key): one
# line and exit 2 before any rank starts, in the catalog (scripts/bad_inputs.py, r26-r33).

RECIPE = ["+model=llama3_debug", "data=tokens", "mesh=2", "sharding=fsdp_blocks_sac", "sharding.param_dtype=bfloat16"]


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """The commands here that start no rank (the recipe's plan=true, text data naming a missing
    file), as typed, one after another in one process (scripts/one_process.py), each through the
    function the `composerun` script calls: {name: (its CompletedProcess, its working directory)}."""
    from one_process import run_commands

    root = tmp_path_factory.mktemp("typed")
    commands = {
        "plan": [*RECIPE, "plan=true", "hydra.run.dir=plan"],
        "missing_text": ["+model=transformer", "data=text", "data.path=no_such.txt"],
    }
    for name in commands:
        (root / name).mkdir()
    procs = run_commands([(args, root / name) for name, args in commands.items()])
    return {name: (proc, root / name) for name, proc in zip(commands, procs, strict=True)}


@pytest.mark.e2e
def test_user_model_and_policy_from_own_config_dir(tmp_path: Path) -> None:
    """A user's model (by _target_) and policy (YAML) in their own config dir, no change to
    composerun: docs/configs.md's example (examples/user_model)."""
    example = REPO / "examples" / "user_model"
    r = cli(
        "--config-dir", str(example / "my_conf"), "+model=two_tower", "sharding=towers", "mesh=2", "train.steps=3",
        "hydra.run.dir=run", cwd=tmp_path, env={"PYTHONPATH": str(example)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    units = {u["fqn"]: u for u in plan["units"]}
    assert set(units) == {f"left.{i}" for i in range(3)} | {f"right.{i}" for i in range(3)} | {"<root>"}
    assert units["right.0"]["options"] == {"reshard_after_forward": False}
    assert plan["policy"] == "towers" and plan["model"] == "two_tower"
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.distributed
def test_transformer_on_shipped_text(tmp_path: Path) -> None:
    """data=text trains the transformer on the sonnets shipped with composerun; the loss falls."""
    train(
        tmp_path / "run", "+model=transformer", "data=text", "model.dim=32", "model.n_layers=2",
        "sharding=fsdp_blocks_ac", "mesh=2", "train.steps=20", "optim.lr=1e-2",
    )  # fmt: skip
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # from ~ln(256) = 5.5 towards the text's statistics
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    apis = {u["fqn"]: u["apis"] for u in plan["units"]}
    assert apis["blocks.0"] == ["checkpoint", "fully_shard"] and apis["blocks.1"] == ["fully_shard"]


@pytest.mark.e2e
def test_text_data_missing_file_is_a_config_error(typed: dict) -> None:
    r, _ = typed["missing_text"]
    assert r.returncode == 2
    assert r.stderr.strip() == "composerun: error: data.path=no_such.txt: no such file; name a local text file"


@pytest.mark.distributed
def test_bf16_selective_ac_trains_and_plans(typed: dict, tmp_path: Path) -> None:
    """The GPU recipe's precision and AC on the CPU: bf16 parameters with selective activation
    checkpointing per block trains (FSDP's input cast stays outside the recomputation), and its
    plan=true, as a user types it, runs the estimate's fake step."""
    summary = train(tmp_path / "run", *RECIPE, "train.steps=3", "train.log_every=1")
    assert summary["status"] == "ok", summary
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[-1]["loss"] < rows[0]["loss"]
    r, cwd = typed["plan"]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    estimate = json.loads((cwd / "plan" / "plan.json").read_text())["estimate"]
    assert estimate["peak_bytes_per_rank"][0] > 0
    # what selective AC saves
    assert max(estimate["without_ac_peak_bytes_per_rank"]) > max(estimate["peak_bytes_per_rank"])
