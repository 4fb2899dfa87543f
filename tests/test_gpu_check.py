"""scripts/gpu_check.py, the prepared GPU check: its dry run on the CPU goes through every item's
plumbing (the install from the tree, the environment, the CUDA tests collected and skipped, the
runs through composerun's CLI with their plan=true estimates, the tables) and writes a JSON and a
markdown table whose figures are there and finite; and the parts that decide what the GPU run
reports (the steady-state intervals, which tests need a GPU, the JUnit outcomes) do what they say."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import patience

REPO = Path(__file__).resolve().parents[1]
# the check's modules import one another by name, as scripts run from scripts/ do: on the path
# only while they are imported, so that no other test finds a script by chance
sys.path.insert(0, str(REPO / "scripts"))
try:
    import gpu_check
    import gpu_check_report
    from gpu_check_runs import steady_rows
finally:
    sys.path.remove(str(REPO / "scripts"))

RAN = ["eager", "compile", "compile+selective AC"]  # on the CPU; compile+float8 and torchtitan need CUDA


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.e2e
def test_dry_run_writes_every_row(tmp_path: Path) -> None:
    # its budget and time limit stretched where the machine is busy: no item skipped or cut for that
    budget = patience(450)
    out, work = tmp_path / "out", tmp_path / "work"  # its installs and runs not left behind in /tmp
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out), "--work", str(work)]
    proc = subprocess.run([*cmd, "--budget-s", f"{budget:.0f}"], capture_output=True, text=True, timeout=budget + 150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    items = {i["name"]: i for i in data["items"]}
    assert data["dry_run"] and data["shape"]["model"] == "llama3_debug"
    for name in ("install", "environment", "CUDA tests", "async checkpoint == sync", *RAN, "compile+float8"):
        assert name in items, (name, list(items))
    assert items["install"]["status"] == items["environment"]["status"] == "ok"
    assert data["environment"]["torch"] and data["environment"]["versions"]["composerun"]
    # the CUDA tests are found and collected, and skip here, the async one among them
    tests = items["CUDA tests"]
    assert tests["status"] == "skipped" and tests["counts"]["skipped"] >= 1 and not tests["counts"]["failed"]
    assert "bringing up nodes" not in Path(tests["log"]).read_text()  # one process, no xdist workers
    assert items["async checkpoint == sync"]["status"] == "skipped"
    assert gpu_check.ASYNC_TEST in items["async checkpoint == sync"]["test"]
    for name in RAN:
        run = items[name]
        assert run["status"] == "ok", (name, run.get("reason"))
        for key in ("step_s", "tokens_per_s", "flops_per_token", "time_to_first_step_s"):
            assert finite(run[key]), (name, key, run[key])
        assert run["steady_steps"][0] > data["shape"]["log_every"]  # the first interval (compile) left out
        assert run["mfu"] is None and run["max_memory_reserved_bytes"] is None  # no GPU: nothing made up
        est = run["estimate"]
        assert est["status"] == "ok" and est["device"] == "H100", (name, est)
        for key in ("peak_bytes", "step_s", "tokens_per_s", "mfu"):
            assert finite(est[key]), (name, key, est[key])
    assert finite(items["eager"]["tracker_peak_bytes"])
    # float8 needs a GPU: skipped with the reason, and its estimate still planned
    assert items["compile+float8"]["status"] == "skipped" and "8.9" in items["compile+float8"]["reason"]
    assert items["compile+float8"]["estimate"]["status"] == "ok"
    torchtitan = next(i for i in data["items"] if i["kind"] == "torchtitan")
    assert torchtitan["status"] == "skipped" and torchtitan["reason"]
    table = (out / "gpu_check.md").read_text()
    assert proc.stdout.rstrip().endswith(table.rstrip())  # printed last too
    for name in (*RAN, "compile+float8", "CUDA tests", "async checkpoint == sync", torchtitan["name"]):
        assert f"| {name} |" in table, name
    assert "| eager | ok |" in table and "dry run" in table
    log = (out / "gpu_check.log").read_text()
    assert "===== eager: ok" in log and "composerun: done" in log


def test_steady_rows_leave_out_warmup_and_the_tracked_step() -> None:
    rows = [{"step": s, "step_s": 1.0} for s in (1, 5, 10, 15, 20)]
    got = steady_rows(rows, warmup=5, tracked=2)
    assert [(first, r["step"]) for first, r in got] == [(6, 10), (11, 15), (16, 20)]
    assert [r["step"] for _, r in steady_rows(rows, warmup=5, tracked=12)] == [10, 20]
    assert steady_rows(rows[:2], warmup=5, tracked=None) == []  # too short: no steady state, not a made-up one


def test_the_gpu_tests_are_found_by_their_skip_reason() -> None:
    marked = '@pytest.mark.skipif(\n    not torch.cuda.is_available(), reason="needs a CUDA GPU"\n)\ndef test_x(): ...'
    assert gpu_check._needs_gpu(marked)
    assert not gpu_check._needs_gpu('@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")\n# a GPU run')
    assert gpu_check._needs_gpu((REPO / "tests" / "test_async_checkpoint.py").read_text())


def test_junit_outcomes_and_a_failed_row(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="t" name="a" time="1.5"/>'
        '<testcase classname="t" name="b" time="2"><failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="t" name="c" time="0"><skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    cases = gpu_check_report.junit_cases(xml)
    assert [(c["name"], c["outcome"], c["message"]) for c in cases] == [
        ("t::a", "passed", ""),
        ("t::b", "failed", "assert 1 == 2"),
        ("t::c", "skipped", "needs a CUDA GPU"),
    ]
    data = {
        "dry_run": False,
        "wall_s": 12.0,
        "budget_s": 450,
        "environment": {"gpu": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "memory_bytes": 85e9},
        "shape": {"model": "llama3_1b", "batch": 4, "steps": 20, "log_every": 5, "param_dtype": "bfloat16"},
        "items": [
            {"name": "compile", "kind": "run", "status": "failed", "reason": "a | b", "estimate": {"status": "ok"}},
            {"name": "CUDA tests", "kind": "tests", "status": "failed", "reason": "x", "cases": cases,
             "counts": {"passed": 1, "failed": 1, "skipped": 1}},
        ],
    }  # fmt: skip
    table = gpu_check_report.markdown(data)
    assert "| compile | failed: a \\| b |" in table  # the reason in its cell, the table intact
    assert "1 passed, 1 failed, 1 skipped (t::b)" in table
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0" in table
