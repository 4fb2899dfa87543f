"""mesh.elastic's rule (pure): the mesh and train.grad_accum a run takes in a world of another
size, and the worlds it refuses.  The expected values are worked out by hand from the rule:
the elastic dim takes world / (the other dims' product); the samples of one replica's
micro-batch (data.batch_size / (replicas x grad_accum) on the configured mesh) stay."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import compose_node, final_weights, read_metrics, train

from composerun.config.elastic import ElasticMesh, elastic_dim, elastic_mesh
from composerun.errors import ConfigError
from composerun.launch import job
from composerun.launch.torchrun import AGREED_RUN_DIR
from composerun.report import write_report


@pytest.mark.parametrize(
    ("shape", "names", "given", "accum", "batch", "world", "want"),
    [
        # 1-D: the shard dim is the only data-parallel dim; 4 -> 2 ranks doubles the accumulation
        ([4], None, None, 1, 8, 2, ElasticMesh((2,), 2, "shard")),
        ([4], None, None, 1, 8, 1, ElasticMesh((1,), 4, "shard")),
        # HSDP 2x2: the outermost dim (replicate) goes, the in-node shard dim stays
        ([2, 2], None, None, 1, 8, 2, ElasticMesh((1, 2), 2, "replicate")),
        ([2, 2], None, None, 3, 24, 2, ElasticMesh((1, 2), 6, "replicate")),
        # growing back past the configured mesh: fewer micro-batches, the same micro-batch
        ([1, 2], None, None, 4, 16, 4, ElasticMesh((2, 2), 2, "replicate")),
        # tensor parallel stays; the shard dim changes and accumulation follows the replicas only
        ([2, 2], ["shard", "tp"], None, 1, 4, 2, ElasticMesh((1, 2), 2, "shard")),
        ([2, 2, 2], ["replicate", "shard", "tp"], None, 2, 16, 4, ElasticMesh((1, 2, 2), 4, "replicate")),
        # elastic_dim names another dim: shard shrinks, replicate stays
        ([2, 4], None, "shard", 1, 16, 4, ElasticMesh((2, 2), 2, "shard")),
        # the world of the mesh: nothing changes
        ([2, 2], None, None, 2, 8, 4, ElasticMesh((2, 2), 2, "replicate")),
    ],
)
def test_elastic_mesh_keeps_the_micro_batch(shape, names, given, accum, batch, world, want) -> None:
    assert elastic_mesh(shape, names, given, accum, batch, world) == want


@pytest.mark.parametrize(
    ("shape", "names", "given", "accum", "batch", "world", "says"),
    [
        # tp=2 left with one rank (the case)
        (
            [2, 2],
            ["shard", "tp"],
            None,
            1,
            4,
            1,
            "a world of 1 ranks is not a multiple of the dims that stay (tp=2 = 2)",
        ),
        # HSDP 2x4 on 6 ranks: the shard dim (4) stays
        ([2, 4], None, None, 1, 8, 6, "a world of 6 ranks is not a multiple of the dims that stay (shard=4 = 4)"),
        # 3 replicas of a micro-batch of 2 cannot make a global batch of 8
        ([4], None, None, 1, 8, 3, "data.batch_size=8 is not a whole number of their micro-batches of 2 samples"),
        # growing past the global batch: 8 replicas of 2 samples exceed 8
        ([4], None, None, 1, 8, 8, "8 data-parallel replicas"),
    ],
)
def test_elastic_mesh_refuses_in_one_line(shape, names, given, accum, batch, world, says) -> None:
    with pytest.raises(ConfigError) as e:
        elastic_mesh(shape, names, given, accum, batch, world)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_elastic_dim_choice_and_refusals() -> None:
    assert elastic_dim([2, 2], None, None) == "replicate"
    assert elastic_dim([2, 2], ["tp", "shard"], None) == "shard"  # the outermost data-parallel dim
    assert elastic_dim([2, 4], None, "shard") == "shard"
    with pytest.raises(ConfigError, match=r"mesh.elastic_dim=tp: a tensor-parallel dim"):
        elastic_dim([2, 2], ["shard", "tp"], "tp")
    with pytest.raises(ConfigError, match=r"mesh.elastic_dim=dp: the mesh's dims are \['replicate', 'shard'\]"):
        elastic_dim([2, 2], None, "dp")
    with pytest.raises(ConfigError, match=r"no data-parallel dim"):
        elastic_dim([2], ["tp"], None)


def test_validate_checks_the_elastic_keys() -> None:
    with pytest.raises(ConfigError, match=r"mesh.elastic_dim=shard does nothing without mesh.elastic=true"):
        compose_node("+model=unit", "mesh=2x2", "mesh.elastic_dim=shard")
    with pytest.raises(ConfigError, match=r"mesh.elastic_dim=dp: the mesh's dims"):
        compose_node("+model=unit", "mesh=2x2", "mesh.elastic=true", "mesh.elastic_dim=dp")


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.delenv("COMPOSERUN_SELF_LAUNCHED", raising=False)
    monkeypatch.delenv(AGREED_RUN_DIR, raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "1")  # (rank 0 prints the change)


def test_launcher_sets_the_mesh_for_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, the config the ranks get has the elastic mesh and accumulation; without
    mesh.elastic, or self-launched, it is the configured one."""
    _torchrun_env(monkeypatch, 2)
    cfg = compose_node("+model=unit", "mesh=2x2", "mesh.elastic=true", "data.batch_size=8", "train.grad_accum=2")
    job._elastic(cfg)
    assert list(cfg.mesh.shape) == [1, 2] and cfg.train.grad_accum == 4 and cfg.data.batch_size == 8
    plain = compose_node("+model=unit", "mesh=2x2", "data.batch_size=8")
    job._elastic(plain)
    assert list(plain.mesh.shape) == [2, 2] and plain.train.grad_accum == 1
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    cfg = compose_node("+model=unit", "mesh=2x2", "mesh.elastic=true", "data.batch_size=8")
    job._elastic(cfg)
    assert list(cfg.mesh.shape) == [2, 2]


def test_self_launched_ranks_take_the_world_their_agents_formed(capsys: pytest.CaptureFixture) -> None:
    """A SLURM node range's ranks (launch/rank.py): the same rule as torchrun's (the torchrun
    test above), on the typed config each rank is handed; the mesh's own world, or no
    mesh.elastic, leaves the config as it is.  Rank 0 alone prints the change."""
    from conftest import compose

    from composerun.launch.rank import elastic_world

    cfg = compose("+model=unit", "mesh=2x2", "mesh.elastic=true", "data.batch_size=8", "train.grad_accum=2")
    smaller = elastic_world(cfg, 2, 1)
    assert (smaller.mesh.shape, smaller.train.grad_accum, smaller.data.batch_size) == ([1, 2], 4, 8)
    assert (cfg.mesh.shape, cfg.train.grad_accum) == ([2, 2], 2)  # (the launcher's config is not changed)
    assert capsys.readouterr().out == ""
    elastic_world(cfg, 2, 0)
    assert capsys.readouterr().out.strip() == (
        "composerun: mesh.elastic: a world of 2 ranks: mesh 2x2 -> 1x2 (replicate changes), "
        "train.grad_accum 2 -> 4, data.batch_size 8 kept"
    )
    assert elastic_world(cfg, 4, 0) is cfg
    plain = compose("+model=unit", "mesh=2x2", "data.batch_size=8")
    assert elastic_world(plain, 2, 0) is plain  # (the mesh's size check then refuses it: parallel/mesh.py)
    with pytest.raises(ConfigError, match=r"a world of 3 ranks is not a multiple of the dims that stay"):
        elastic_world(cfg, 3, 0)


def test_self_launched_ranks_refuse_a_world_the_rule_cannot_take(tmp_path) -> None:
    """What the ranks of a node range meet when the agents form a world the rule cannot take
    (validate.py refuses such a range before any rank starts; here 3 ranks are started by
    hand on 2x2): the launcher's one line, a ConfigError, and nothing trained."""
    from conftest import compose

    from composerun.checkpoint.start import Start
    from composerun.launch.agent import launch

    cfg = compose("+model=unit", "model.dim=8", "mesh=2x2", "mesh.elastic=true", "metrics.progress=false")
    with pytest.raises(ConfigError, match=r"^mesh.elastic=true: a world of 3 ranks is not a multiple of the dims"):
        launch(cfg, tmp_path, 3, Start())
    assert not (tmp_path / "metrics.jsonl").exists()


def test_restarted_ranks_resume_the_newest_checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of ranks that torch's agents started again (the same rendezvous id) picks the run
    directory's newest checkpoint; the first ranks of a launch load what the launcher handed
    them, whatever the files hold by then, and so do another launch's (another id)."""
    from conftest import compose

    from composerun.checkpoint.start import Start
    from composerun.launch.rank import this_world

    run = tmp_path / "run"
    train(run, "+model=unit", "model.dim=8", "mesh=1", "train.steps=2", "checkpoint.every=1")
    cfg = compose("+model=unit", "model.dim=8", "mesh=1", "train.steps=4")
    handed = Start(run / "checkpoints" / "step-00000001", step=1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    assert this_world(cfg, run, handed, 0) == (cfg, handed)
    _, again = this_world(cfg, run, handed, 0)
    assert (again.load, again.step, again.resume) == (run / "checkpoints" / "step-00000002", 2, "auto")
    assert this_world(cfg, run, handed, 1)[1] is handed  # (the other ranks load rank 0's: train/run.py)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4243")
    assert this_world(cfg, run, handed, 0)[1] is handed


def test_launcher_refuses_elastic_restarts_on_the_shared_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch's store shared across restarts, a restarted rank may read a dead rank's address."""
    _torchrun_env(monkeypatch, 4)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    cfg = compose_node("+model=unit", "mesh=2x2", "mesh.elastic=true")
    with pytest.raises(ConfigError, match=r"needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        job._elastic(cfg)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restart: nothing is read twice
    job._elastic(cfg)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    job._elastic(cfg)


def test_launcher_refuses_elastic_without_a_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart would agree on a new timestamped directory and start over."""
    _torchrun_env(monkeypatch, 4)
    monkeypatch.setenv(AGREED_RUN_DIR, "1")
    cfg = compose_node("+model=unit", "mesh=2x2", "mesh.elastic=true")
    with pytest.raises(ConfigError, match=r"mesh.elastic=true under torchrun needs hydra.run.dir=DIR"):
        job._elastic(cfg)


BASE = ("+model=unit", "model.dim=8", "sharding=hsdp", "checkpoint.every=2", "data.batch_size=8")


@pytest.mark.distributed
def test_resume_on_fewer_replicas_records_the_change(tmp_path) -> None:
    """A 2x2 run's step-2 checkpoint resumed on 1x2 with twice the micro-batches (the mesh
    mesh.elastic picks for 2 ranks) ends bit-equal to the uninterrupted 2x2 run (its
    micro-batches hold the same samples) and continues its loss curve, and the records say what
    changed, once."""
    reference = tmp_path / "reference"
    train(reference, *BASE, "mesh=2x2", "train.steps=4")
    run = tmp_path / "run"
    train(run, *BASE, "mesh=2x2", "train.steps=2")
    shrunk = elastic_mesh([2, 2], None, None, 1, 8, 2)
    assert shrunk == ElasticMesh((1, 2), 2, "replicate")
    summary = train(
        run, *BASE, "mesh=2x2", "mesh.shape=[1,2]", f"train.grad_accum={shrunk.grad_accum}", "train.steps=4"
    )

    got, want = final_weights(run, *BASE), final_weights(reference, *BASE)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the uninterrupted run"
    rows = {r["step"]: r for r in read_metrics(run)}
    # the logged loss is a sum over replicas and micro-batches taken in another order: its last bits move
    assert [r["loss"] for r in read_metrics(run)] == pytest.approx(
        [r["loss"] for r in read_metrics(reference)], rel=1e-6
    )
    change = rows[3]["mesh_change"]
    assert [s for s, r in rows.items() if "mesh_change" in r] == [3]
    assert change["step"] == 2 and (change["old_mesh"], change["new_mesh"]) == ("2x2", "1x2")
    assert (change["old_grad_accum"], change["grad_accum"]) == (1, 2) and change["old_world_size"] == 4
    assert 0 < change["seconds_lost"] < 300 and change["lost_from"] == "checkpoint published"
    assert summary["mesh_changes"] == [change]
    write_report(run)  # composerun-report's table shows it
    (row,) = csv.DictReader((run / "summary.csv").open())
    assert row["mesh_changes"] == f"2x2->1x2 at step 2 ({change['seconds_lost']:.1f} s lost)"
