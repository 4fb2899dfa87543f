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
