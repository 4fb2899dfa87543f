"""Sharding policies end to end: a user's own model and policy through the CLI, text data, the GPU
recipe's bf16 and selective AC on the CPU (its training on gloo ranks, its plan=true as typed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, compose, patience, read_metrics

# A bad policy (an unknown api, a glob or a class that matches nothing, an api given twice, a
# mesh dim the mesh lacks, HSDP on a 1-D mesh, no data-parallel rule, an unknown rule key): one
# line and exit 2 before any rank starts, in the catalog (scripts/bad_inputs.py, r26-r33).

TEXT = ["+model=transformer", "data=text"]
RECIPE = ["+model=llama3_debug", "data=tokens", "mesh=2", "sharding=fsdp_blocks_sac", "sharding.param_dtype=bfloat16"]


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The commands here, as typed, one after another, each in a child of one fork process
    (scripts/one_process.py: the console script's function with the command's argv, directory
    and environment, less the seconds of importing composerun again for each): a user's model
    and policy from their own config dir, the recipe's plan=true, text data naming a missing
    file.  {name: (its CompletedProcess, its working directory)}."""
    from one_process import Forks

    root = tmp_path_factory.mktemp("typed")
    example = REPO / "examples" / "user_model"
    user_path = os.pathsep.join(filter(None, [str(example), os.environ.get("PYTHONPATH")]))
    conf_dir = ["--config-dir", str(example / "my_conf")]
    commands = {
        "user_model": (
            [*conf_dir, "+model=two_tower", "sharding=towers", "mesh=2", "train.steps=3", "hydra.run.dir=run"],
            {"PYTHONPATH": user_path},
        ),
        "plan": ([*RECIPE, "plan=true", "hydra.run.dir=plan"], {}),
        "missing_text": ([*TEXT, "data.path=no_such.txt"], {}),
    }
    forks = Forks()
    out = {}
    try:
        for name, (args, env) in commands.items():
            cwd = root / name
            cwd.mkdir()
            full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **env}
            child = forks.start("composerun", args, cwd, full_env, cwd / "stdout.txt", cwd / "stderr.txt")
            code = child.wait(patience(300))
            proc = subprocess.CompletedProcess(
                ["composerun", *args], code, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text()
            )
            out[name] = (proc, cwd)
    finally:
        forks.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """The runs that are not about the command line, on one launch of 2 gloo ranks, one after
    the other (tests/fixtures/matrix.py): {name: (run dir, rank 0's summary)}."""
    from fixtures.matrix import train_all

    from composerun.config.schema import LaunchConfig, StartMethod
    from composerun.launch.agent import start_ranks

    root = tmp_path_factory.mktemp("runs")
    jobs = {
        # 8 steps at lr 2e-2 fall by ~2.4 (ln(256) = 5.5 to 3.3), over twice what the test asks
        "text": [
            *TEXT,
            "model.dim=32",
            "model.n_layers=2",
            "mesh=2",
            "sharding=fsdp_blocks_ac",
            "train.steps=8",
            "optim.lr=2e-2",
        ],
        "recipe": [*RECIPE, "train.steps=3", "train.log_every=1"],
    }
    configs = [(name, compose(*ov, "metrics.progress=false")) for name, ov in jobs.items()]
    lcfg = LaunchConfig(start_method=StartMethod.forkserver)
    summaries = start_ranks(train_all, (configs, str(root)), 2, root, lcfg)[0]
    return {name: (root / name, summaries[name]) for name in jobs}


@pytest.mark.e2e
def test_user_model_and_policy_from_own_config_dir(typed: dict) -> None:
    """A user's model (by _target_) and policy (YAML) in their own config dir, no change to
    composerun: docs/configs.md's example (examples/user_model)."""
    r, cwd = typed["user_model"]
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((cwd / "run" / "plan.json").read_text())
    units = {u["fqn"]: u for u in plan["units"]}
    assert set(units) == {f"left.{i}" for i in range(3)} | {f"right.{i}" for i in range(3)} | {"<root>"}
    assert units["right.0"]["options"] == {"reshard_after_forward": False}
    assert plan["policy"] == "towers" and plan["model"] == "two_tower"
    assert [row["step"] for row in read_metrics(cwd / "run")] == [1, 2, 3]


@pytest.mark.distributed
def test_transformer_on_shipped_text(runs: dict) -> None:
    """data=text trains the transformer on the sonnets shipped with composerun; the loss falls."""
    run, summary = runs["text"]
    assert summary["status"] == "ok", summary
    rows = read_metrics(run)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # from ~ln(256) = 5.5 towards the text's statistics
    plan = json.loads((run / "plan.json").read_text())
    apis = {u["fqn"]: u["apis"] for u in plan["units"]}
    assert apis["blocks.0"] == ["checkpoint", "fully_shard"] and apis["blocks.1"] == ["fully_shard"]


@pytest.mark.e2e
def test_text_data_missing_file_is_a_config_error(typed: dict) -> None:
    r, _ = typed["missing_text"]
    assert r.returncode == 2
    assert r.stderr.strip() == "composerun: error: data.path=no_such.txt: no such file; name a local text file"


@pytest.mark.distributed
def test_bf16_selective_ac_trains_and_plans(typed: dict, runs: dict) -> None:
    """The GPU recipe's precision and AC on the CPU: bf16 parameters with selective activation
    checkpointing per block trains (FSDP's input cast stays outside the recomputation), and its
    plan=true, as a user types it, runs the estimate's fake step."""
    run, summary = runs["recipe"]
    assert summary["status"] == "ok", summary
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[-1]["loss"] < rows[0]["loss"]
    r, cwd = typed["plan"]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    estimate = json.loads((cwd / "plan" / "plan.json").read_text())["estimate"]
    assert estimate["peak_bytes_per_rank"][0] > 0
    # what selective AC saves
    assert max(estimate["without_ac_peak_bytes_per_rank"]) > max(estimate["peak_bytes_per_rank"])
