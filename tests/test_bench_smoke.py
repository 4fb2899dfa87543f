"""The CPU benchmark runs end to end (tiny sizes) and reports every ratio; no timing is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

RATIO_KEYS = [
    "step_time_d16_m2",
    "startup",
    "ckpt_save_vs_dcp",
    "ckpt_load_vs_dcp",
    "ckpt_save_vs_disk",
    "ckpt_load_vs_disk",
    "dcp_save_vs_disk",
    "dcp_load_vs_disk",
    "bare_load_vs_disk",
    "ckpt_cold_load_vs_bare",
    "disk_read_new_memory_vs_disk",
    "async_stall_vs_sync_save",
    "memory_d16_m2",
]


def test_bench_cpu_smoke(tmp_path: Path) -> None:
    before = (REPO / "BENCHMARKS.md").read_text()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_cpu.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "cpu.json").read_text())
    ratios = result["summary"]["ratios"]
    for key in RATIO_KEYS:
        assert key in ratios, key
        assert math.isfinite(ratios[key]) and ratios[key] > 0, (key, ratios[key])
    assert result["step_time"]["d16_m2"]["same_losses"]  # both sides did the same work
    assert (tmp_path / "cpu.md").read_text().startswith("## CPU:")
    assert (REPO / "BENCHMARKS.md").read_text() == before  # the smoke never touches the repository's file
