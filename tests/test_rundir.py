"""The run directory's owner (composerun/rundir.py), pure: its paths are the files a run
writes (spelt out here as a user sees them), its summary reader takes only a readable
object, its writer leaves no half-written file, and the search for runs, the records a
start_over moves aside and the records a failed start puts back are what the launcher and
the reports rely on."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from composerun.rundir import RunDir


def test_every_path_is_the_file_a_user_finds(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.checkpoints == tmp_path / "checkpoints"
    assert run.metrics == tmp_path / "metrics.jsonl"
    assert run.plan == tmp_path / "plan.json"
    assert run.hydra == tmp_path / ".hydra"
    assert run.hydra_files == tuple(tmp_path / ".hydra" / n for n in ("config.yaml", "hydra.yaml", "overrides.yaml"))
    assert run.tensorboard == tmp_path / "tb"
    assert run.agent_logs == tmp_path / "torchelastic"
    assert run.lock == tmp_path / ".composerun.lock"
    assert run.rank_log(3) == tmp_path / "rank3.log"
    assert run.export("safetensors") == tmp_path / "export" / "model.safetensors"
    assert run.export("hf") == tmp_path / "export" / "hf"


def test_the_summary_reader_takes_a_readable_object_only(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    path = tmp_path / "summary.json"
    assert run.read_summary() is None  # none there
    for text in ("{not json", "[1, 2]", ""):
        path.write_text(text)
        assert run.read_summary() is None, text
    path.write_text('{"status": "ok", "steps": 4}')
    assert run.read_summary() == {"status": "ok", "steps": 4}
    # written before `since` (an earlier run's): not this launch's
    old = time.time() - 100
    os.utime(path, (old, old))
    assert run.read_summary(since=old + 50) is None
    assert run.read_summary(since=old - 50) == {"status": "ok", "steps": 4}


def test_the_summary_writer_replaces_the_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path)
    run.write_summary({"status": "ok"})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "ok"}

    def full_disk(self: Path, data: str) -> int:
        Path.write_bytes(self, data.encode()[:3])  # a part of it, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        run.write_summary({"status": "failed", "error": "x" * 100})
    monkeypatch.undo()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "ok"}  # the earlier one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temporary file left


def test_runs_under_a_sweep_leave_out_checkpoints_and_replaced_folders(tmp_path: Path) -> None:
    for rel in ("10", "2", "2/checkpoints/step-00000002", "2/replaced-2026-01-01_00-00-00", "a/b", "nothing"):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        if rel != "nothing":
            (tmp_path / rel / "summary.json").write_text("{}")
    assert [r.path for r in RunDir.under(tmp_path)] == [tmp_path / "2", tmp_path / "10", tmp_path / "a" / "b"]


def test_start_over_moves_the_earlier_records_aside_and_keeps_the_rest(tmp_path: Path) -> None:
    for rel in ("checkpoints/step-00000004/manifest.json", ".hydra/config.yaml", "summary.json", "rank0.log"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    run = RunDir(tmp_path)
    assert sorted(run.records()) == [".hydra", "checkpoints", "summary.json"]  # not a log of the run
    dest = run.move_aside(run.records())
    assert dest is not None and dest.parent == tmp_path and dest.name.startswith("replaced-")
    assert (dest / "checkpoints" / "step-00000004" / "manifest.json").read_text().startswith("checkpoints/")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rank0.log", dest.name])
    assert run.move_aside([]) is None


def test_a_fresh_directory_holds_only_what_a_start_leaves(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    assert not run.is_fresh()  # not there
    for name in ("rank0.log", "rank12.log", ".composerun.lock", "composerun.log"):
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / name).write_text("")
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / "torchelastic").mkdir()
    assert run.is_fresh()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert not run.is_fresh()
    run.discard_if_fresh()
    assert (tmp_path / "run" / "metrics.jsonl").exists()  # a run's: kept
    (tmp_path / "run" / "metrics.jsonl").unlink()
    run.discard_if_fresh()
    assert not (tmp_path / "run").exists()


def test_a_failed_start_puts_the_earlier_records_back_byte_for_byte(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_bytes(b"train:\n  steps: 4\n")
    (tmp_path / "summary.json").write_bytes(b'{"status": "ok"}\n')
    run = RunDir(tmp_path)
    kept = run.keep_records()
    (tmp_path / ".hydra" / "config.yaml").write_text("train:\n  steps: 6\n")  # what the new start wrote
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- train.steps=6\n")
    (tmp_path / "summary.json").write_text('{"status": "failed"}')
    kept.put_back()
    assert (tmp_path / ".hydra" / "config.yaml").read_bytes() == b"train:\n  steps: 4\n"
    assert not (tmp_path / ".hydra" / "overrides.yaml").exists()  # the earlier run had none
    assert (tmp_path / "summary.json").read_bytes() == b'{"status": "ok"}\n'
    # a new run directory: nothing of an earlier run to put back; what the failed start wrote stays
    fresh = RunDir(tmp_path / "new")
    (tmp_path / "new").mkdir()
    kept = fresh.keep_records()
    (tmp_path / "new" / "summary.json").write_text('{"status": "failed"}')
    kept.put_back()
    assert (tmp_path / "new" / "summary.json").read_text() == '{"status": "failed"}'


def test_an_export_is_done_when_the_summary_names_it_and_it_is_there(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    summary = {"status": "ok", "export": str(tmp_path / "export" / "model.safetensors")}
    assert not run.exported_already(summary, "safetensors")  # named, not there
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_bytes(b"x")
    assert run.exported_already(summary, "safetensors")
    assert not run.exported_already(summary, "hf")  # another kind
    assert not run.exported_already({"status": "ok", "export": None}, "safetensors")
    assert not run.exported_already(None, "safetensors")
