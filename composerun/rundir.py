"""The run directory: every name in it, and the one reader and writer of its summary.json.

A run directory holds what a run leaves (`RunDir`'s properties name each): `.hydra/` (the
config as run), `plan.json`, `metrics.jsonl`, `tb/`, `sinks.json`, `profile/`, `flight_recorder/`,
`checkpoints/`, `export/`, `summary.json`, a log per rank, the elastic agent's folder and the lock.  Every wing asks
this module for a path instead of spelling one, so a name changes in one place, and
summary.json, which the launcher, the ranks and the reports all read, has one writer.

Files a later run reads (summary.json, plan.json) are never left half-written: each is
written to a temporary name beside it and renamed into place (`write_json`)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

_SUMMARY = "summary.json"
_HYDRA = ".hydra"
_HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # the config, Hydra's own, the overrides typed
_CHECKPOINTS = "checkpoints"
_REPLACED = "replaced-"  # start_over's folder of an earlier run's records: replaced-<date>_<time>
# where checkpoint.export (by its value) writes in a run directory
_EXPORTS = {"safetensors": Path("export") / "model.safetensors", "hf": Path("export") / "hf", "peft": Path("export") / "peft"}
# An earlier run's records; `checkpoint.start_over=true` moves them aside.
_RECORDS = (_HYDRA, _CHECKPOINTS, "metrics.jsonl", _SUMMARY, "plan.json", "export", "tb", "sinks.json", "profile", "flight_recorder")
# What a run directory holds before its first step, or after a command that failed before it
# (composerun.log: Hydra's job log, written only if a handler asks for it):
_FRESH = re.compile(r"^(\.hydra|composerun\.log|rank\d+\.log|torchelastic|\.composerun\.lock)$")


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise


@dataclass(frozen=True)
class RunDir:
    """One run directory (`hydra.run.dir`, or a job's directory of a sweep)."""

    path: Path

    @property
    def checkpoints(self) -> Path:
        return self.path / _CHECKPOINTS

    @property
    def metrics(self) -> Path:
        """One JSON row per logged step (train/metrics.py)."""
        return self.path / "metrics.jsonl"

    @property
    def plan(self) -> Path:
        """The applied plan (parallel/plan.py)."""
        return self.path / "plan.json"

    @property
    def hydra(self) -> Path:
        return self.path / _HYDRA

    @property
    def hydra_files(self) -> tuple[Path, ...]:
        """`.hydra/`'s files, in the order config.yaml, hydra.yaml, overrides.yaml."""
        return tuple(self.hydra / name for name in _HYDRA_FILES)

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def sink_ids(self) -> Path:
        """The W&B and MLflow run ids (train/sinks.py), so that a resumed run logs into the same runs."""
        return self.path / "sinks.json"

    def profile(self, rank: int) -> Path:
        """Rank `rank`'s profiler traces and memory snapshots (train/profile.py)."""
        return self.path / "profile" / f"rank{rank}"

    @property
    def flight_recorder(self) -> Path:
        """Every rank's flight-recorder dump, `rank_{R}` (train/flight_recorder.py)."""
        return self.path / "flight_recorder"

    @property
    def agent_logs(self) -> Path:
        """The folder of torch's elastic agent (its ranks' error files)."""
        return self.path / "torchelastic"

    def ranks_started(self, run_id: str) -> Path:
        """Written by rank 0 when the ranks of the agents' rendezvous `run_id` first start: a
        rank 0 that finds it was started again (launch/rank.py)."""
        return self.agent_logs / f"started-{run_id}"

    @property
    def lock(self) -> Path:
        return self.path / ".composerun.lock"

    def rank_log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.log"

    def export(self, kind: str) -> Path:
        """Where `checkpoint.export=KIND` writes (a file for safetensors, a folder for hf)."""
        return self.path / _EXPORTS[str(kind)]

    # --- summary.json: read and written here only -----------------------------------------

    def read_summary(self, since: float = 0.0) -> dict[str, Any] | None:
        """summary.json, or None (none there, unreadable, not an object, or written before
        `since`, a time.time(): an earlier run's)."""
        path = self.path / _SUMMARY
        try:
            if since and path.stat().st_mtime < since:
                return None
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / _SUMMARY, summary)

    def exported_already(self, summary: dict[str, Any] | None, kind: str) -> bool:
        """Whether a finished run's summary names an export of this kind that is still there
        (then the same command again, checkpoint.export included, has nothing to do)."""
        done, where = (summary or {}).get("export"), _EXPORTS.get(str(kind))
        return bool(done) and where is not None and Path(done).name == where.name and (self.path / where).exists()

    @staticmethod
    def under(root: Path) -> list[RunDir]:
        """Every run directory under `root` (each holds a summary.json; not those an earlier
        run's checkpoints or a start_over's folder hold), in sweep order."""
        runs = [
            p.parent
            for p in root.rglob(_SUMMARY)
            if _CHECKPOINTS not in p.parts and not any(part.startswith(_REPLACED) for part in p.parts)
        ]
        # a sweep's jobs by number (2 before 10), any other folder by name after them
        runs.sort(key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.relative_to(root).parts])
        return [RunDir(p) for p in runs]

    # --- what a start leaves, and what start_over moves aside -------------------------------

    def is_fresh(self) -> bool:
        """Whether it holds nothing but what a start leaves (logs, the agent's folder, the lock)."""
        return self.path.is_dir() and all(_FRESH.match(p.name) for p in self.path.iterdir())

    def discard_if_fresh(self) -> None:
        """A run directory holding nothing but what a start leaves came from this failed
        command: remove it, so that nothing is left that looks like a run."""
        if self.is_fresh():
            shutil.rmtree(self.path, ignore_errors=True)

    def records(self) -> list[str]:
        """The names of an earlier run's records that are here (what start_over moves aside)."""
        return [name for name in _RECORDS if (self.path / name).exists()]

    def move_aside(self, names: list[str]) -> Path | None:
        """Move an earlier run's records (`names`, here) into replaced-<date>_<time>/ here."""
        if not names:
            return None
        dest = self.path / f"{_REPLACED}{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"
        n = 1
        while dest.exists():
            n += 1
            dest = self.path / f"{_REPLACED}{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}-{n}"
        dest.mkdir()
        for name in names:
            if (self.path / name).exists() or (self.path / name).is_symlink():
                os.rename(self.path / name, dest / name)
        return dest

    def keep_records(self) -> EarlierRecords:
        """summary.json and the `.hydra/` files a start rewrites, as they are now."""
        return EarlierRecords(self.path, (_SUMMARY, *(str(p.relative_to(self.path)) for p in self.hydra_files)))


class EarlierRecords:
    """The records an earlier run left (summary.json, the `.hydra/` files a start rewrites),
    kept in memory while a new start is tried: a start whose ranks fail before they have
    loaded the state (a checkpoint that fails its checksum, a checkpoints/ that cannot be
    written) puts them back as they were, byte for byte."""

    def __init__(self, run_dir: Path, names: tuple[str, ...]) -> None:
        self.run_dir = run_dir
        self.saved: dict[str, bytes | None] = {}
        for rel in names:
            try:
                self.saved[rel] = (run_dir / rel).read_bytes()
            except FileNotFoundError:
                self.saved[rel] = None

    def put_back(self) -> None:
        if all(v is None for v in self.saved.values()):
            return  # a new run: nothing of an earlier one to keep (its .hydra/ says what failed)
        for rel, data in self.saved.items():
            path = self.run_dir / rel
            try:
                if data is None:
                    path.unlink(missing_ok=True)
                elif not path.is_file() or path.read_bytes() != data:
                    tmp = path.with_name(path.name + ".tmp")
                    tmp.write_bytes(data)
                    tmp.replace(path)
            except OSError:
                pass  # a full disk, say: the command's line is what the user gets
