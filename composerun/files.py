"""Files a later run reads (summary.json, plan.json) are never left half-written: each is
written to a temporary name beside it and renamed into place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's summary.json, or None (none there, unreadable, not an object)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


# where checkpoint.export (by its value) writes in a run directory
EXPORTS = {"safetensors": Path("export") / "model.safetensors", "hf": Path("export") / "hf"}


def exported_already(summary: dict[str, Any] | None, kind: str, run_dir: Path) -> bool:
    """Whether a finished run's summary names an export of this kind that is still there (then
    the same command again, checkpoint.export included, has nothing to do)."""
    done, where = (summary or {}).get("export"), EXPORTS.get(str(kind))
    return bool(done) and where is not None and Path(done).name == where.name and (run_dir / where).exists()
