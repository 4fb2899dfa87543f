"""profile.*: torch.profiler traces of profile.steps on every rank (distributed), no profiler at
all when off, and the one line a rank that runs out of memory ends with (end-to-end, an
allocation failure simulated on CPU by a user model that raises torch.OutOfMemoryError)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, cli, read_metrics, train

COLLECTIVES = re.compile(r"^(gloo:|nccl:|c10d::)(all_?reduce|all_?gather|_allgather|_reduce_scatter)")


def events(trace: Path) -> list[dict[str, Any]]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run of 4 steps with profile.steps=[2,3] (two tests read it)."""
    run = tmp_path_factory.mktemp("profiled") / "run"
    train(run, "+model=unit", "model.dim=8", "mesh=2", "train.steps=4", "profile.steps=[2,3]")
    return run


@pytest.mark.distributed
def test_profiled_steps_leave_a_chrome_trace_on_every_rank(profiled: Path) -> None:
    """profile.steps=[2,3] of 4: each rank's trace holds steps 2 and 3 (not 1, not 4), the ops
    inside them with their shapes, the collectives, and the allocator's memory events."""
    run = profiled
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    for rank in (0, 1):
        files = sorted(p.name for p in (run / "profile" / f"rank{rank}").iterdir())
        assert files == ["steps-2-3.pt.trace.json"], files
        trace = run / "profile" / f"rank{rank}" / files[0]
        evs = events(trace)
        steps = {e["name"]: e for e in evs if e["name"].startswith("composerun step")}
        assert sorted(steps) == ["composerun step 2", "composerun step 3"]
        inside = [e for e in evs if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps.values())]
        names = {e["name"] for e in inside}
        assert {"aten::addmm", "aten::relu"} <= names, sorted(names)[:40]
        assert any(COLLECTIVES.match(n) for n in names), sorted(n for n in names if "::" not in n)
        assert any(e.get("args", {}).get("Input Dims") for e in inside if e["name"] == "aten::addmm")  # record_shapes
        memory = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
        assert memory, "profile_memory: the allocator's events"


def test_no_profiler_object_when_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off is free: a run without profile.steps never makes a torch.profiler.profile (one rank,
    in this process, so the count is this process's); one with it makes exactly one."""
    made: list[int] = []
    real = torch.profiler.profile

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.profiler, "profile", counting)
    base = ("+model=unit", "model.dim=8", "train.steps=2", "launch.start_method=fork")
    train(tmp_path / "off", *base)
    assert made == [] and not (tmp_path / "off" / "profile").exists()
    train(tmp_path / "on", *base, "profile.steps=[1,2]")
    assert made == [1] and (tmp_path / "on" / "profile" / "rank0" / "steps-1-2.pt.trace.json").is_file()


@pytest.mark.e2e
def test_out_of_memory_is_one_line_with_the_peak_the_estimate_and_what_to_try(tmp_path: Path) -> None:
    """Rank 1 raises torch.OutOfMemoryError in its second step: the command ends with one line
    naming the rank, the step, the peak, plan=true's estimate of the same config (planned first
    in the same run directory), why there is no snapshot on a CPU, and what to try."""
    args = ("+model=unit", "model._target_=faulty.OutOfMemoryOnRank", "model.dim=8", "mesh=2", "train.steps=5")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "fixtures"), os.environ.get("PYTHONPATH", "")])}
    r = cli(*args, "plan=true", "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    estimated = json.loads((tmp_path / "run" / "summary.json").read_text())["est_peak_bytes"]
    r = cli(*args, "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("composerun: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = lines[0]
    assert line.startswith("composerun: error: rank 1 failed: OutOfMemory: out of memory at step 2 on rank 1 "), line
    assert "Tried to allocate 20.00 GiB (simulated)" in line
    assert re.search(r"peak resident \d+\.\d [KMG]iB \(the process's\)", line), line
    from composerun.parallel.plan import fmt_bytes  # (the estimate's own figure, as plan=true printed it)

    assert f"plan=true's estimated peak {fmt_bytes(estimated)} per rank" in line, line
    assert "no memory snapshot (a cpu device has no CUDA allocator history)" in line
    assert "try a smaller micro-batch" in line and "sharding=fsdp_blocks_ac" in line
    assert "out of memory at step 2 on rank 1" in (tmp_path / "run" / "rank1.log").read_text()
    assert not (tmp_path / "run" / "profile").exists()  # no snapshot without CUDA
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_the_allocator_history_api_takes_what_composerun_passes() -> None:
    """The private CUDA allocator calls of _torch_compat (profile.memory_snapshot), pinned on any
    torch build: they exist and take what composerun passes (checked without a GPU)."""
    import inspect

    import torch.cuda.memory as cuda_memory

    record = inspect.signature(cuda_memory._record_memory_history).parameters
    assert list(record)[0] == "enabled" and {"stacks", "max_entries"} <= set(record)
    assert list(inspect.signature(cuda_memory._dump_snapshot).parameters)[0] == "filename"


def test_the_reports_self_times_are_torchs_own(tmp_path: Path) -> None:
    """composerun-report's self time per op, read from an exported trace, is what torch's own
    key_averages says of the same profile (op by op, calls too); the steps' time of a run with no
    collective is all compute."""
    from composerun.profile_report import complete_events, self_times, split

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for n, rows in ((1, 16), (2, 7)):  # two steps of different shapes
            with torch.profiler.record_function(f"composerun step {n}"):
                model(torch.randn(rows, 32)).square().mean().backward()
    path = tmp_path / "steps-1-2.pt.trace.json"
    prof.export_chrome_trace(str(path))
    events = complete_events(path)
    ours = self_times(events)
    theirs = {a.key: (a.self_cpu_time_total, a.count) for a in prof.key_averages()}
    for op in ("aten::addmm", "aten::mm", "aten::relu", "aten::threshold_backward", "aten::sum", "aten::t"):
        (us, calls), (want_us, want_calls) = ours[op], theirs[op]
        assert calls == want_calls, op
        assert us == pytest.approx(want_us, rel=0.02, abs=2.0), op
    s = split(events)
    assert s["steps"] == 2 and s["comm_us"] == 0
    assert s["compute_us"] == pytest.approx(s["steps_us"]) and s["steps_us"] > 0


@pytest.mark.distributed
def test_composerun_report_sums_up_the_profiled_steps(profiled: Path) -> None:
    """composerun-report RUN of a profiled 2-rank run: profile_summary.md has each rank's steps
    with their communication time (the collectives' union, > 0) and compute adding up to them,
    and the top ops by self time (a collective among them)."""
    from composerun.profile_report import complete_events, split
    from composerun.report import write_report

    run = profiled
    paths = write_report(run)
    assert paths[-1] == run / "profile_summary.md"
    text = paths[-1].read_text()
    for rank in (0, 1):
        s = split(complete_events(run / "profile" / f"rank{rank}" / "steps-2-3.pt.trace.json"))
        assert s["steps"] == 2 and 0 < s["comm_us"] < s["steps_us"]
        assert s["comm_us"] + s["compute_us"] == pytest.approx(s["steps_us"])
        assert f"| {rank} | steps-2-3.pt.trace.json | 2 | {s['steps_us'] / 1e3:.2f} |" in text
    ops = [line.split(" | ")[0].lstrip("| ") for line in text.split("by self time")[1].splitlines()[4:]]
    assert any(COLLECTIVES.match(op) for op in ops if op), ops


@pytest.mark.e2e
def test_a_hung_rank_leaves_every_ranks_flight_recorder_and_one_line(tmp_path: Path) -> None:
    """Rank 1 stops for 10 s inside its third forward (a rank that hangs); rank 0's next
    collective waits launch.collective_timeout=3 s and fails.  The command ends with one line
    naming rank 0, the collective it waited in and rank 1 as the rank that never started it;
    both ranks left a dump of their last profile.flight_recorder=10 collectives, and torch's own
    analyzer, reading the folder, finds the same collective with rank 1 missing."""
    import pickle
    import subprocess
    import sys

    args = ("+model=unit", "model._target_=faulty.StallsOnRank", "model.dim=8", "mesh=2", "train.steps=5")
    args += ("model.kwargs={stall_s: 10}", "launch.collective_timeout=3", "profile.flight_recorder=10")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "fixtures"), os.environ.get("PYTHONPATH", "")])}
    r = cli(*args, "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("composerun: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line, folder = lines[0], tmp_path / "run" / "flight_recorder"
    head = "composerun: error: rank 0 failed: CollectiveTimeout: a collective timed out on rank 0 after 3 s "
    assert line.startswith(head + "(launch.collective_timeout), in the last collective it started: gloo:"), line
    m = re.search(r"gloo:(\w+) #(\d+) of group default_pg \(ranks \[0, 1\]\)", line)
    assert m, line
    op, seq = m.group(1), int(m.group(2))
    assert f"never started by rank(s) 1 (their last: rank 1 #{seq - 1})" in line, line
    assert f"the flight recorder's dumps are in {folder}" in line, line
    dumps = {rank: pickle.loads((folder / f"rank_{rank}").read_bytes()) for rank in (0, 1)}
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1"]  # nothing half-written
    for rank, last_seq in ((0, seq), (1, seq - 1)):
        ids = [e["collective_seq_id"] for e in dumps[rank]["entries"]]
        assert ids == list(range(last_seq - 9, last_seq + 1)), (rank, ids)  # the last 10 only, in order
        assert all(e["frames"] for e in dumps[rank]["entries"])  # with their Python stacks
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    from composerun import _torch_compat as compat

    if not compat.analyzer_reads_gloo():  # (torch 2.11's reads NCCL's dumps only)
        assert "fr_trace" not in line, line
        return
    assert f"(python -m torch.distributed.flight_recorder.fr_trace {folder} matches them up)" in line, line
    analyzer = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)]
    out = subprocess.run(analyzer, capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert f"Not all ranks joining collective, sequence number: {seq}" in said, said[-3000:]
    assert f"collective: gloo:{op}" in said and "missing ranks: {1}" in said, said[-3000:]


def test_the_flight_recorders_variables_are_set_for_the_run_and_put_back(tmp_path: Path, monkeypatch) -> None:
    """profile.flight_recorder sets torch's variables for the ranks' process group (the size, and
    where and when NCCL dumps) only inside the run, putting back what was there; 0 keeps none
    (torch's own default would keep some) and names no dump."""
    from conftest import compose

    from composerun.train import flight_recorder

    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    before = dict(os.environ)
    with flight_recorder.armed(compose("+model=unit", "profile.flight_recorder=25"), tmp_path):
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "25"  # (read before the deprecated name: left as it is)
        assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
        assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert dict(os.environ) == before
    with flight_recorder.armed(compose("+model=unit", "profile.flight_recorder=0"), tmp_path):
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0" and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert dict(os.environ) == before and not (tmp_path / "flight_recorder").exists()  # made only on a GPU


def test_the_launchers_line_names_the_dumps_nccl_left_in_this_launch(tmp_path: Path) -> None:
    """A rank that NCCL's watchdog ended has no error of its own: the launcher's line names the
    dumps written since the ranks started, not an earlier run's, nor one still being written."""
    from composerun.launch.agent import _flight_recorder_dumps

    folder = tmp_path / "flight_recorder"
    folder.mkdir()
    (folder / "rank_0").write_bytes(b"earlier")
    os.utime(folder / "rank_0", (1000.0, 1000.0))
    assert _flight_recorder_dumps(tmp_path, since=2000.0) == ""
    for name in ("rank_1", "rank_3", "rank_2.tmp"):
        (folder / name).write_bytes(b"now")
    text = _flight_recorder_dumps(tmp_path, since=2000.0)
    assert text == (
        f"; a collective timed out: the flight recorder's dumps are in {folder} (rank_1, rank_3; "
        f"python -m torch.distributed.flight_recorder.fr_trace {folder} reads them)"
    )


# --- on a GPU (scripts/gpu_check.py runs these whenever one is lent) ------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_oom_leaves_a_memory_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank on the GPU allocates 1 PiB in its second step: the line names the allocator's
    peak of the GPU's memory and the snapshot the default profile.memory_snapshot=on_oom dumped,
    which holds the allocator's segments and its history."""
    import pickle

    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures"))
    run = tmp_path / "run"
    kwargs = "model.kwargs={oom_rank: 0, real: true}"
    with pytest.raises(Exception) as exc:  # noqa: PT011 - the launcher's RunFailed, whose line is checked
        train(run, "+model=unit", "model._target_=faulty.OutOfMemoryOnRank", "model.dim=8", "train.steps=3", kwargs)
    line, snap = str(exc.value), run / "profile" / "rank0" / "oom-step-2.pickle"
    assert "OutOfMemory: out of memory at step 2 on rank 0 (CUDA out of memory." in line, line
    assert re.search(r"peak allocated [\d.]+ [KMG]?i?B of [\d.]+ GiB", line), line
    assert f"memory snapshot {snap} " in line, line
    snapshot = pickle.loads(snap.read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"]), "the allocator's state and its history"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profiled_steps_on_a_gpu_hold_kernels_and_a_memory_snapshot(tmp_path: Path) -> None:
    """profile.memory_snapshot=steps on the GPU: the trace holds the steps' CUDA kernels (the
    report's compute), and memory-steps-2-3.pickle the allocator's history over them."""
    import pickle

    from composerun.profile_report import complete_events, split

    run = tmp_path / "run"
    train(run, "+model=unit", "model.dim=64", "train.steps=3", "profile.steps=[2,3]", "profile.memory_snapshot=steps")
    folder = run / "profile" / "rank0"
    assert sorted(p.name for p in folder.iterdir()) == ["memory-steps-2-3.pickle", "steps-2-3.pt.trace.json"]
    events = complete_events(folder / "steps-2-3.pt.trace.json")
    assert any(e.get("cat") == "kernel" for e in events)
    s = split(events)
    assert s["steps"] == 2 and 0 < s["compute_us"] <= s["steps_us"]
    assert any(pickle.loads((folder / "memory-steps-2-3.pickle").read_bytes())["device_traces"])


NCCL_RECORDER = """
import json, os, pickle, socket, sys
from pathlib import Path
from types import SimpleNamespace
import torch, torch.distributed as dist
from composerun import _torch_compat as compat
from composerun.config.schema import MeshConfig, ProfileConfig
from composerun.train import flight_recorder

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
run = Path(sys.argv[1])
with flight_recorder.armed(SimpleNamespace(profile=ProfileConfig(flight_recorder=3), mesh=MeshConfig()), run):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    t = torch.ones(4, device="cuda")
    for _ in range(5):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    entries = pickle.loads(compat.flight_recorder_dump(True))["entries"]
    print(json.dumps([[e["collective_seq_id"], e["profiling_name"]] for e in entries]))
    dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccls_flight_recorder_keeps_what_profile_flight_recorder_asks(tmp_path: Path) -> None:
    """On the GPU (a fresh process: NCCL reads the variables once): one NCCL rank under
    profile.flight_recorder=3 runs five all-reduces; NCCL's recorder kept the last three, which
    composerun's dump reads, and the folder NCCL's watchdog dumps into on a timeout exists."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", NCCL_RECORDER, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    entries = json.loads(out.stdout.strip().splitlines()[-1])
    assert entries == [[3, "nccl:all_reduce"], [4, "nccl:all_reduce"], [5, "nccl:all_reduce"]], entries
    assert (tmp_path / "flight_recorder").is_dir()
