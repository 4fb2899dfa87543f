"""Checkpoints on real gloo ranks: resharding, async saves, atomic publishing, export/init."""

from __future__ import annotations

import functools
import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_close_weights,
    choose_start,
    compose,
    final_weights,
    latest_checkpoint,
    latest_name,
    read_metrics,
    set_latest,
    train,
)
from fixtures.matrix import load_gather_continue

from composerun.checkpoint import folders, reader
from composerun.checkpoint import manifest as manifests
from composerun.config import world_size_of
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.errors import CheckpointError, ConfigError, RunFailed
from composerun.launch.agent import launch, start_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP loads with no group
]

BASE = [
    "+model=composite",
    "model.dim=10",
    "metrics.progress=false",
]  # 10 rows: uneven shards on 4 and 8 ranks, empty ones on 8
# The runs here read no measured memory peak: they leave out the step torch's memory tracker
# watches (metrics.track_memory), a large part of a tiny run's CPU.
RUN = [*BASE, "metrics.track_memory=false"]
LCFG = LaunchConfig(start_method=StartMethod.forkserver)


def _flat_optim(osd: dict) -> dict[str, torch.Tensor]:
    return {f"{fqn}.{k}": torch.as_tensor(v) for fqn, st in osd["state"].items() for k, v in st.items()}


def saved_optim(ckpt: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """The checkpoint's `optim` entry, loaded without a process group into a plain AdamW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from composerun.models import build_model
    from composerun.train.optim import build_optimizer

    cfg = compose(*(overrides or BASE))
    model = build_model(cfg.model)
    osd = get_optimizer_state_dict(model, build_optimizer(model, cfg.optim))
    dcp.load({"optim": osd}, checkpoint_id=str(ckpt))
    return _flat_optim(osd)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Composite trained 2 steps on each mesh, checkpointed (and exported) at step 2."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for mesh in ["1", "2", "2x2", "2x4"]:
        train(root / mesh, *RUN, f"mesh={mesh}", "train.steps=2", "checkpoint.export=safetensors")
        out[mesh] = latest_checkpoint(root / mesh)
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Composite, 4 uninterrupted steps on one rank."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(run, *RUN, "mesh=1", "train.steps=4")
    return run


# The module's saved runs, as the cells of the reshard matrix compare with them: each loaded
# once (with no process group), not once a cell.  The runs are the module fixtures' and no test
# changes them; the dicts are only read.
@functools.cache
def _saved_weights(run: Path) -> dict[str, torch.Tensor]:
    return final_weights(run, *BASE)


@functools.cache
def _saved_optim(ckpt: Path) -> dict[str, torch.Tensor]:
    return saved_optim(ckpt)


@pytest.mark.parametrize("load_mesh", ["1", "2", "2x2"])
def test_reshard_matrix(saved, straight, tmp_path: Path, load_mesh: str) -> None:
    """Saved on 1, 2, 2x2, 2x4; resumed here: model and optimizer exact, the continued run within 1e-6."""
    cfg = compose(*RUN, f"mesh={load_mesh}", "train.steps=4")
    jobs = [(f"from{mesh}", cfg, str(path)) for mesh, path in saved.items()]
    world = world_size_of(cfg.mesh.shape)
    results = start_ranks(load_gather_continue, (jobs, str(tmp_path)), world, tmp_path, LCFG)[0]
    for name, (msd, osd, summary) in results.items():
        src = saved[name.removeprefix("from")]
        assert_close_weights(dict(msd), _saved_weights(src.parents[1]), 0.0, f"{name} model after load")
        want_optim = _saved_optim(src)
        assert_close_weights(_flat_optim(osd), want_optim, 0.0, f"{name} optimizer after load")
        assert summary["start_step"] == 2 and summary["steps"] == 4
        assert [r["step"] for r in read_metrics(tmp_path / name)] == [3, 4]
        assert_close_weights(final_weights(tmp_path / name, *BASE), _saved_weights(straight), 1e-6, name)
    assert {k.split(".")[-1] for k in want_optim} == {"step", "exp_avg", "exp_avg_sq"}


def test_async_saves_load_back(tmp_path: Path) -> None:
    """Five async saves in a row, training in between: each equals the sync run's checkpoint."""
    common = [*RUN, "mesh=2", "train.steps=10", "checkpoint.every=2", "checkpoint.keep=5"]
    train(tmp_path / "async", *common, "checkpoint.async=true")
    train(tmp_path / "sync", *common)
    steps = sorted(p.name for p in (tmp_path / "async" / "checkpoints").glob("step-*"))
    assert steps == [f"step-{s:08d}" for s in (2, 4, 6, 8, 10)]
    for name in steps:
        for run in ("async", "sync"):  # final_weights reads `latest`: point it at each in turn
            set_latest(tmp_path / run / "checkpoints", name)
        got, want = final_weights(tmp_path / "async", *BASE), final_weights(tmp_path / "sync", *BASE)
        assert_close_weights(got, want, 0.0, f"async {name}")
        manifests.check_integrity(tmp_path / "async" / "checkpoints" / name)
    stalls = [r["checkpoint_stall_s"] for r in read_metrics(tmp_path / "async") if "checkpoint_stall_s" in r]
    assert len(stalls) == 5


def test_failed_publish_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A save that fails while it is published (its manifest cannot be written) leaves
    `latest` on the previous checkpoint.  Its folder, every file written and recorded by its
    rank, is recovered by the next run, which resumes from it (a folder cut short or damaged
    is removed instead: tests/test_async_checkpoint.py)."""
    run = tmp_path / "run"
    real = folders.write_manifest
    calls = []

    def failing(ckpt: Path, meta: dict, *files) -> None:
        calls.append(ckpt)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        real(ckpt, meta, *files)

    monkeypatch.setattr(folders, "write_manifest", failing)
    with pytest.raises(RunFailed, match="disk full"):
        train(run, *RUN, "mesh=1", "train.steps=4", "checkpoint.every=2")
    root = run / "checkpoints"
    assert latest_name(root) == "step-00000002"
    assert [p.name for p in root.glob("step-00000004*")] == [calls[1].name]  # the tmp folder, unpublished
    assert ".tmp-" in calls[1].name
    monkeypatch.setattr(folders, "write_manifest", real)

    summary = train(run, *RUN, "mesh=1", "train.steps=4", "checkpoint.every=2")
    assert Path(summary["resumed_from"]).name == "step-00000004"
    assert not list(root.glob("*.tmp-*"))
    assert latest_name(root) == "step-00000004"
    manifests.check_integrity(root / "step-00000004")


def test_the_ranks_load_the_checkpoint_they_are_handed(tmp_path: Path) -> None:
    """Where a run starts is decided once, before any rank starts (checkpoint/start.py): 2 ranks
    handed step 2 load step 2, though by the time they start `latest` names step 1 (a decision
    made again in the ranks would take step 1, the newest complete checkpoint `latest` names)."""
    run, args = tmp_path / "run", [*RUN, "mesh=2", "checkpoint.every=1", "launch.start_method=forkserver"]
    train(run, *args, "train.steps=2")
    root = run / "checkpoints"
    cfg = compose(*args, "train.steps=3")
    start = choose_start(cfg, run)
    assert (start.load, start.step) == (root / "step-00000002", 2)
    set_latest(root, "step-00000001")  # what the ranks would now find for themselves
    assert folders.find_latest(root, strict=True) == root / "step-00000001"
    summary = launch(cfg, run, 2, start)
    assert Path(summary["resumed_from"]).name == "step-00000002" and summary["start_step"] == 2


def test_a_rerun_after_a_stop_keeps_one_row_per_step(tmp_path: Path) -> None:
    """A run stopped after it logged steps 3 and 4 (and a line cut short) but before their
    checkpoint was published: the same command trains 3 and 4 again, and metrics.jsonl holds
    one row per step (the report, summary.json and a user's script read it as it is)."""
    import shutil

    run, args = tmp_path / "run", [*RUN, "mesh=1", "train.steps=4", "checkpoint.every=2"]
    train(run, *args)
    first = read_metrics(run)
    root = run / "checkpoints"
    shutil.rmtree(root / "step-00000004")
    set_latest(root, "step-00000002")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    summary = train(run, *args)
    assert summary["start_step"] == 2
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in first]  # (the resume is exact)


@pytest.mark.parametrize("model", ["composite", "fusion_embedding_with_hook", "fusion_embedding_with_modifier"])
def test_export_then_init_from(saved, tmp_path: Path, model: str) -> None:
    """Export (composite on 2x4, the fusion models on 2): the file's keys are the model's own
    state_dict() keys (hooks and _fqn_modifiers respected), its values the checkpoint's; a
    1-rank model initialised from it holds exactly those weights."""
    from safetensors.torch import load_file

    ov = [f"+model={model}", "metrics.progress=false", *(["model.dim=10"] if model == "composite" else [])]
    if model == "composite":
        src = saved["2x4"].parents[1]
    else:
        src = tmp_path / "src"
        train(src, *ov, "mesh=2", "train.steps=2", "checkpoint.export=safetensors", "metrics.track_memory=false")
    exported = load_file(src / "export" / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(src / "export" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"  # what Hugging Face's loaders require
    from composerun.models import build_model

    assert sorted(exported) == sorted(build_model(compose(*ov).model).state_dict())  # safetensors sorts keys
    if model != "composite":
        assert "weight" in exported and "embedding.weight" not in exported
    assert_close_weights(exported, dict(sorted(final_weights(src, *ov).items())), 0.0, "export")

    # one rank, fully_shard-ed as composerun does, initialised from the file
    from composerun.checkpoint.export import full_state_dict_on_rank0, init_from
    from composerun.parallel.apply import apply_policy
    from composerun.parallel.mesh import init_mesh, teardown

    cfg = compose(*ov, "mesh=1")
    mesh, _ = init_mesh(cfg.mesh)
    try:
        torch.manual_seed(999)
        net = build_model(cfg.model)
        apply_policy(net, cfg.sharding, mesh)
        init_from(net, src / "export" / "model.safetensors")
        assert_close_weights(dict(sorted(full_state_dict_on_rank0(net).items())), exported, 0.0, "init_from")
    finally:
        teardown()


def handed(run_dir: Path, ckpt: Path, *overrides: str) -> dict:
    """The ranks of a run handed `ckpt` to load, as the launcher hands them the checkpoint it
    chose (checkpoint/start.py), without its checks: what the ranks meet when a file changed
    after the launcher checked it."""
    from composerun.checkpoint.start import Start

    cfg = compose(*overrides, f"checkpoint.resume={ckpt}", "launch.start_method=forkserver", "metrics.progress=false")
    run_dir.mkdir(parents=True, exist_ok=True)
    return launch(cfg, run_dir, world_size_of(cfg.mesh.shape), Start(ckpt, resume=str(ckpt)))


def test_resume_refuses_another_model(saved, tmp_path: Path) -> None:
    """Refused before any rank starts (exit 2), and by the ranks as they load it."""
    another = r"holds another model \(composite\): missing keys \['seq.1.bias'"
    with pytest.raises(ConfigError, match=another):
        train(tmp_path / "run", "+model=unit", "model.dim=16", f"checkpoint.resume={saved['2']}")
    with pytest.raises(RunFailed, match=another):
        handed(tmp_path / "run", saved["2"], "+model=unit", "model.dim=16")


def test_resume_refuses_another_size_of_the_model(saved, tmp_path: Path) -> None:
    """Same keys, other shapes: refused by name before DCP reads anything, before any rank
    starts and in the ranks."""
    other = r"holds another size of this model \(composite\): l1.weight is \[10, 10\] there, \[16, 16\] here"
    with pytest.raises(ConfigError, match=other):
        train(tmp_path / "run", "+model=composite", "model.dim=16", "mesh=2", f"checkpoint.resume={saved['2']}")
    with pytest.raises(RunFailed, match=other):
        handed(tmp_path / "run", saved["2"], "+model=composite", "model.dim=16", "mesh=2")


def test_find_latest_and_resume_by_run_dir(saved, tmp_path: Path) -> None:
    """checkpoint.resume may name a run directory or its checkpoints/ folder (its newest
    complete checkpoint); a newer step folder that lost its manifest is an error on resume,
    not skipped (that would train its steps again from an older one)."""
    import shutil

    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (1, 2):
        shutil.copytree(saved["2"], root / f"step-{step:08d}")
    (root / "latest").write_text("step-00000002")
    for named in (run, root):
        assert folders.resolve_resume(named) == root / "step-00000002"
    assert folders.resolve_resume(root / "step-00000001") == root / "step-00000001"

    (root / "step-00000002" / "manifest.json").unlink()
    assert folders.find_latest(root) == root / "step-00000001"  # inspect, the preempt line: skipped
    with pytest.raises(
        CheckpointError, match=r"step-00000002: no manifest.json, .*move it out of .* to resume from .*step-00000001"
    ):
        folders.find_latest(root, strict=True)
    with pytest.raises(
        ConfigError, match=r"step-00000002: no manifest.json, not a complete checkpoint.*new hydra.run.dir"
    ):
        train(run, *RUN, "mesh=2", "train.steps=3")  # (refused before any rank starts: exit 2)
    (root / "latest").write_text("")  # an empty pointer: the newest complete folder
    shutil.rmtree(root / "step-00000002")
    assert folders.find_latest(root, strict=True) == root / "step-00000001"
    empty = tmp_path / "no_checkpoints"
    (empty / "checkpoints").mkdir(parents=True)  # a run directory of a run that saved none
    with pytest.raises(CheckpointError, match=r"no_checkpoints: no complete checkpoint in it"):
        folders.resolve_resume(empty)


def test_tampered_and_truncated_files_are_refused(saved, tmp_path: Path) -> None:
    import shutil

    for how in ("tamper", "truncate", "metadata"):
        copy = tmp_path / how / "step-00000002"
        shutil.copytree(saved["2"], copy)
        if how == "metadata":  # a pickle that would import os.system is never unpickled
            (copy / ".metadata").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
            with pytest.raises(CheckpointError, match="not allowed in DCP metadata"):
                reader.SafeReader(str(copy)).read_metadata()
            continue
        data = copy / "__1_0.distcp"
        raw = data.read_bytes()
        data.write_bytes(raw[:-100] if how == "truncate" else raw[:50] + bytes([raw[50] ^ 1]) + raw[51:])
        before = {p.name: p.read_bytes() for p in copy.iterdir()}
        expected = ("truncated or damaged" if how == "truncate" else "checksum mismatch") + (
            r".*; resume from another checkpoint .*checkpoint.resume=never"
        )
        if how == "truncate":  # a file's size is checked before any rank starts (exit 2)
            with pytest.raises(ConfigError, match=expected):
                train(tmp_path / how / "run", *RUN, "mesh=2", f"checkpoint.resume={copy}")
        with pytest.raises(RunFailed, match=expected):  # a data file's checksum as the ranks read it
            handed(tmp_path / how / "run", copy, *RUN, "mesh=2")
        assert {p.name: p.read_bytes() for p in copy.iterdir()} == before  # nothing overwritten
        # it failed before its first step: no summary.json (the line says why; an existing run's stays as it was)
        assert not (tmp_path / how / "run" / "summary.json").exists()


def test_checksums_written_while_saving_match_the_files(saved, tmp_path: Path) -> None:
    """Each rank hashes its files as DCP writes them (nothing is read back): the manifest's
    sizes and checksums equal the files' own, read back here, for both algorithms; and a
    sha256 manifest is checked on resume like an xxh3_128 one."""
    for mesh in ("2", "2x2"):
        manifest = manifests.read_manifest(saved[mesh])
        assert set(manifest["files"]) == {p.name for p in saved[mesh].iterdir()} - {"manifest.json"}
        assert manifest["files"] == manifests.hash_files(saved[mesh], "xxh3_128")
    run = tmp_path / "sha"
    train(run, *RUN, "mesh=2", "train.steps=2", "checkpoint.checksum=sha256", "checkpoint.async=true")
    ckpt = latest_checkpoint(run)
    manifest = manifests.read_manifest(ckpt)
    assert manifest["files"] == manifests.hash_files(ckpt, "sha256")
    data = ckpt / "__0_0.distcp"
    raw = data.read_bytes()
    data.write_bytes(raw[:80] + bytes([raw[80] ^ 1]) + raw[81:])
    with pytest.raises(RunFailed, match="checksum mismatch"):
        train(tmp_path / "again", *RUN, "mesh=2", "train.steps=3", f"checkpoint.resume={ckpt}")


def test_verify_against_one_rank_reference(tmp_path: Path) -> None:
    """checkpoint.verify=true: model, FQN-keyed optimizer state and the optimizer round trip
    match a 1-rank reference; summary.json carries the report."""
    summary = train(
        tmp_path / "ok", *RUN, "mesh=2", "sharding=fsdp_ac", "train.steps=3", "train.grad_accum=2",
        "checkpoint.verify=true",
    )  # fmt: skip
    report = summary["verify"]
    assert report["ok"] and report["model"]["keys_equal"] and report["optim"]["param_groups_equal"]
    assert report["model"]["max_abs_diff"] <= 1e-5 and report["optim_round_trip"]["ok"]


def test_verify_catches_a_mismatch(tmp_path: Path) -> None:
    """A model that computes differently on each rank fails verification: exit non-zero, one line."""
    with pytest.raises(RunFailed, match="verification failed: model differs from the 1-rank reference"):
        train(
            tmp_path / "bad", "+model=unit", "model._target_=fixtures.faulty.DriftsOnRank", "model.dim=8", "mesh=2",
            "train.steps=3", "checkpoint.verify=true", "metrics.progress=false", "metrics.track_memory=false",
        )  # fmt: skip
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["status"] == "failed" and not summary["verify"]["model"]["ok"]


def test_resume_a_model_with_extra_state(tmp_path: Path) -> None:
    """A user's model whose state dict holds a non-tensor (`get_extra_state`): the shape
    check before the load leaves it to DCP, and the run resumes (on 2 ranks; the extra state
    is checked as it is loaded back: tests/fixtures/extra_state.py)."""
    run = tmp_path / "run"
    args = (
        "+model=unit",
        "model._target_=fixtures.extra_state.Versioned",
        "model.dim=8",
        "mesh=2",
        "metrics.track_memory=false",
    )
    train(run, *args, "train.steps=2")
    saved_keys = reader.SafeReader(str(latest_checkpoint(run))).read_metadata().state_dict_metadata
    assert any(k.endswith("_extra_state") for k in saved_keys), sorted(saved_keys)  # the non-tensor was saved
    summary = train(run, *args, "train.steps=3")
    assert summary["start_step"] == 2 and summary["resumed_from"].endswith("step-00000002")
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


REFERENCE_MODELS = {
    "unit": ["model.dim=10"],
    "composite": ["model.dim=10"],
    "unit_param": ["model.dim=10"],
    "composite_param": ["model.dim=10"],
    "nested_sequential": [],
    "fusion_embedding": [],
    "fusion_embedding_with_hook": [],
    "fusion_embedding_with_modifier": [],  # torch's utilities key its state two ways (checkpoint/state.py)
}


def test_every_reference_model_resumes_on_another_mesh(tmp_path: Path) -> None:
    """Each of torch's reference models: saved after 2 steps on mesh 2x2 (fsdp over its 4
    ranks), resumed on mesh 2: model and optimizer exactly what was saved, and 2 more steps
    end within 1e-6 of 4 uninterrupted steps on one rank."""
    from fixtures.matrix import train_all

    common = ["metrics.progress=false", "metrics.track_memory=false", "data.batch_size=8", "checkpoint.every=2"]

    def cfg(name: str, mesh: str, steps: int) -> dict:
        return compose(f"+model={name}", *REFERENCE_MODELS[name], *common, f"mesh={mesh}", f"train.steps={steps}")

    names = list(REFERENCE_MODELS)
    start_ranks(train_all, ([(n, cfg(n, "2x2", 2)) for n in names], str(tmp_path / "saved")), 4, tmp_path, LCFG)
    start_ranks(train_all, ([(n, cfg(n, "1", 4)) for n in names], str(tmp_path / "straight")), 1, tmp_path, LCFG)
    jobs = [(n, cfg(n, "2", 4), str(latest_checkpoint(tmp_path / "saved" / n))) for n in names]
    results = start_ranks(load_gather_continue, (jobs, str(tmp_path / "resumed")), 2, tmp_path, LCFG)[0]
    for name in names:
        msd, osd, summary = results[name]
        overrides = [f"+model={name}", *REFERENCE_MODELS[name]]
        saved = tmp_path / "saved" / name
        assert summary["start_step"] == 2 and summary["steps"] == 4, name
        assert_close_weights(dict(msd), final_weights(saved, *overrides), 0.0, f"{name}: the model as loaded")
        want_optim = saved_optim(latest_checkpoint(saved), *overrides)
        assert want_optim and set(_flat_optim(osd)) == set(want_optim), name
        assert_close_weights(_flat_optim(osd), want_optim, 0.0, f"{name}: the optimizer as loaded")
        resumed, straight = (
            final_weights(tmp_path / "resumed" / name, *overrides),
            final_weights(tmp_path / "straight" / name, *overrides),
        )
        assert_close_weights(resumed, straight, 1e-6, f"{name}: resumed on mesh 2 vs 4 steps on one rank")


def _zip_items(ckpt: Path) -> list[zipfile.ZipFile]:
    """Each stored item of a DCP checkpoint as the zip archive torch.save wrote."""
    from composerun.checkpoint.reader import SafeReader

    reader = SafeReader(str(ckpt))
    md = reader.read_metadata()
    out = []
    for info in md.storage_data.values():
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out.append(zipfile.ZipFile(io.BytesIO(f.read(info.length))))
    return out


def test_checkpoints_open_as_dcp_users_expect(saved, tmp_path: Path) -> None:
    """`checkpoints/latest` is a path dcp.load opens; DCP's metadata names the published
    folder, not the temporary one it was written in; the zip records carry no CRC-32 unless
    checkpoint.zip_crc32=true, and then every item passes zipfile's own test."""
    import torch.distributed.checkpoint as dcp

    from composerun.checkpoint.reader import SafeReader
    from composerun.models import build_model

    ckpt = saved["2"]
    sd = build_model(compose(*BASE).model).state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(ckpt.parent / "latest"))
    assert_close_weights(sd, _saved_weights(ckpt.parents[1]), 0.0, "loaded through latest")
    assert SafeReader(str(ckpt)).read_metadata().storage_meta.checkpoint_id == str(ckpt)
    assert any(z.testzip() is not None for z in _zip_items(ckpt))  # CRC-32 = 0: zipfile's test fails

    train(tmp_path / "crc", *RUN, "mesh=2", "train.steps=1", "checkpoint.zip_crc32=true")
    items = _zip_items(latest_checkpoint(tmp_path / "crc"))
    assert items and all(z.testzip() is None for z in items)
