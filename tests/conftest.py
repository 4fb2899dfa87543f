"""Shared helpers for the three test tiers.

- `compose(...)`: the resolved config as the ranks receive it (the schema's dataclasses),
  through Hydra's compose API and composerun's own checks (pure tier); `compose_node(...)`:
  the same as Hydra's DictConfig.
- `train(...)`: a real run on gloo ranks started by torch's elastic agent, exactly as the
  CLI starts them, from a fork server kept for the session (distributed tier).
- `cli(...)`: the `composerun` console script as typed, forked from one process of the session
  that has imported it (end-to-end tier).
"""

from __future__ import annotations

import copy
import functools
import json
import os

# The test process computes with one OpenMP thread, set before torch is imported, so that its
# OpenMP runtime never starts a thread team: the tests that fork ranks from it (to patch
# composerun in them) would otherwise hang in GCC's OpenMP, which does not survive a fork of
# a process that ran a parallel region (seen in a full run: a forked rank's first optimizer
# step waited forever in gomp_team_barrier_wait_end).  Ranks set their own thread count.
os.environ["OMP_NUM_THREADS"] = "1"
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from omegaconf import DictConfig

from composerun.cli import quote_mesh_choices
from composerun.config import Config, register, to_typed, world_size_of
from composerun.config import validate as validate_config

register()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # the catalog of bad inputs, and one_process to run commands in one process


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    """Hydra's composition of `overrides`, once per session for each distinct list: it reads
    only the package's YAML files and the schema, and costs ~0.3 s of CPU, which the suite paid
    for over a thousand times (every `train`, `final_weights` and `check_plan` composes).  A
    composition that fails raises every time (nothing is cached)."""
    with initialize_config_module(config_module="composerun.configs", version_base="1.3"):
        return hydra_compose("train", overrides=quote_mesh_choices(list(overrides)))


def compose_node(*overrides: str, validate: bool = True) -> DictConfig:
    cfg = copy.deepcopy(_composed(tuple(overrides)))  # a test's own copy, checked afresh
    if validate:
        validate_config(cfg)
    return cfg


def compose(*overrides: str, validate: bool = True) -> Config:
    return to_typed(compose_node(*overrides, validate=validate))


# The modules that take longest, scheduled first, so that none of them is what the other workers
# wait for at the end (pytest-xdist hands each worker whole modules in the order collected).
LONGEST_FIRST = ["test_readme", "test_bad_inputs", "test_elastic_loopback", "test_policies", "test_hf_any",
                 "test_throughput_rules", "test_checkpoint", "test_loader", "test_preempt", "test_hf_tp", "test_lora",
                 "test_gpu_check", "test_bench_smoke", "test_profile", "test_slurm", "test_kill"]  # fmt: skip


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: a pytest without xdist runs the suite in one process)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than the cores, at most 8.  A test spends much of its time
    waiting on processes it started (ranks, a launcher, their imports), so on 2 cores a third
    worker keeps both busier (one worker kept them ~40 % busy, three ~60 %).  Two workers a core
    was tried in a CI run and is not safe yet: test_loader's runs failed DCP's save-plan check
    on one worker (to be found), and the GPU check's dry run hit its time limit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, cores + 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist only: a run in one process keeps the order asked for (.ci/run's compat tier
    puts the modules that fork ranks from the test process first)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))  # stable


def _preload_fork_server() -> None:
    """The ranks the tests start in this process (`train`, `start_ranks` with
    start_method=forkserver) come from one fork server, started by the first of them and kept
    for the session: it imports torch and composerun once, where a spawned rank imports them
    again for every launch (most of a small run's time).  Set here so that the server preloads
    them whichever launch starts it (composerun's launcher sets it only for a world above 1).
    A fork server keeps the environment it started with: a test whose ranks read a variable it
    sets passes start_method="spawn", or sets it in a rank entry of its own (tests/test_loader.py)."""
    import importlib.util
    import multiprocessing

    from composerun.launch.agent import RANK_MODULES

    # (+model=hf's ranks: transformers and its model code, imported once here, not in every rank)
    hf = ["transformers", "transformers.modeling_utils"] if importlib.util.find_spec("transformers") else []
    multiprocessing.set_forkserver_preload([*RANK_MODULES, *hf])


_preload_fork_server()


def train(run_dir: Path, *overrides: str, start_method: str = "forkserver") -> dict[str, Any]:
    """Run composerun's rank code on prod(mesh) gloo ranks, from where the launcher's one
    decision starts it (checkpoint/start.py, without the rest of the launcher's checks);
    returns rank 0's summary."""
    from composerun.launch.agent import launch

    cfg = compose(*overrides, f"launch.start_method={start_method}", "metrics.progress=false")
    run_dir.mkdir(parents=True, exist_ok=True)
    start = choose_start(cfg, run_dir)
    if start_method == "fork":  # nothing of an earlier in-process test left for a rank's collector
        import gc

        gc.collect()
    return launch(cfg, run_dir, world_size_of(cfg.mesh.shape), start)


def choose_start(cfg: Config, run_dir: Path) -> Any:
    """checkpoint/start.py's decision for `cfg` in `run_dir`, as the launcher makes it (a
    ConfigError where the launcher refuses the start)."""
    from composerun.checkpoint.start import choose
    from composerun.launch.preflight import meta_model, model_shapes

    return choose(cfg, run_dir, model_shapes(meta_model(cfg)))


def patience(seconds: float) -> float:
    """A guard against a hang of `seconds` (on an idle machine), stretched for a busy one: at
    least twice, more where the load is above the cores.  The suite runs beside other work, and
    no test may fail because the machine is slow."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return seconds * max(2.0, os.getloadavg()[0] / cores)


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300, prog: list[str] | None = None):
    """`composerun ARGS` as a user types it; returns the CompletedProcess.  `timeout` guards
    against a hang (stretched by `patience`).  composerun's own console scripts (`prog` None,
    or one of them by path) run forked from one process of the session that has imported them
    (scripts/one_process.py: its argv, folder, environment and session as a shell gives them,
    less the seconds of its imports); any other `prog` (torchrun, `python -m`) runs as typed."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    cmd = (prog or [str(Path(sys.executable).with_name("composerun"))]) + list(args)
    script = Path(cmd[0])
    if script.parent != Path(sys.executable).parent or script.name not in _CONSOLE_SCRIPTS:
        return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=patience(timeout))
    import signal
    import tempfile

    with tempfile.TemporaryDirectory(prefix="composerun-cli-") as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        proc = _forks().start(script.name, list(args), cwd, full_env, out, err)
        try:
            code = proc.wait(patience(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # (the child is the leader of its own session)
            proc.wait()
            raise
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


_CONSOLE_SCRIPTS = ("composerun", "composerun-ckpt", "composerun-report", "composerun-tokenize")


@functools.cache
def _forks() -> Any:
    """The session's fork process for `cli` (one per worker), started on first use."""
    import atexit

    from one_process import Forks

    forks = Forks()
    atexit.register(forks.close)
    return forks


def cli_into_closed_pipe(*args: str, cwd: Path, prog: list[str], timeout: float = 120) -> tuple[int, str]:
    """`PROG ARGS | head` once head has gone: stdout is a pipe whose reader is closed before
    the command writes a byte.  Returns the exit status and what it wrote to stderr."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*prog, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, err


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@contextmanager
def one_rank_mesh() -> Iterator[Any]:
    """A 1-rank gloo group and its device mesh on a private HashStore, in this process,
    destroyed afterwards even when the body fails (the `mesh` fixture's; test_optim holds one
    for its module)."""
    import torch
    import torch.distributed as dist

    from composerun.config.schema import Backend, Device, MeshConfig
    from composerun.parallel.mesh import init_mesh, teardown

    with pytest.MonkeyPatch.context() as patch:
        for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            patch.delenv(var, raising=False)
        assert not dist.is_initialized(), "a process group leaked into this test from an earlier one"
        try:
            device_mesh, device = init_mesh(MeshConfig(shape=[1], device=Device.cpu, backend=Backend.gloo))
            assert device == torch.device("cpu")
            assert dist.get_world_size() == 1 and device_mesh.size() == 1
            yield device_mesh
        finally:
            try:
                teardown()
            finally:
                if dist.is_initialized():  # teardown's barrier failed: destroy anyway
                    dist.destroy_process_group()
                # The test's sharded models hold the group in reference cycles: collected now, here,
                # not in a rank a later test forks from this process, whose collector would run the
                # group's destructor on the copy of a gloo thread's condition variable (it hung there).
                import gc

                gc.collect()
    assert not dist.is_initialized()


@pytest.fixture
def mesh():
    """A 1-rank gloo group and its device mesh for one test (one_rank_mesh)."""
    with one_rank_mesh() as device_mesh:
        yield device_mesh


def latest_name(root: Path) -> str | None:
    """The step folder `checkpoints/latest` names (a symlink), or None."""
    from composerun.checkpoint.folders import read_latest

    return read_latest(root)


def set_latest(root: Path, name: str) -> None:
    """Point `checkpoints/latest` at the step folder `name`, as a save does."""
    from composerun.checkpoint.folders import point_latest

    point_latest(root, root / name)


def latest_checkpoint(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    assert (root / "latest").is_symlink(), "checkpoints/latest is a symlink (dcp.load opens it)"
    path = root / latest_name(root)
    assert (path / ".metadata").is_file(), f"{path} is not a complete DCP checkpoint"
    return path


def final_weights(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """The run's newest checkpoint loaded into the plain, unsharded model, with no process
    group (DCP's no_dist mode): every tensor comes from the checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    from composerun.models import build_model

    torch.manual_seed(12345)
    sd = build_model(compose(*overrides, validate=False).model).state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(latest_checkpoint(run_dir)))
    return {k: v.detach().clone() for k, v in sd.items()}


def assert_close_weights(got: dict[str, Any], want: dict[str, Any], atol: float, what: str) -> None:
    assert list(got) == list(want), f"{what}: state-dict keys differ"
    diffs = {k: (got[k].float() - want[k].float()).abs().max().item() if want[k].numel() else 0.0 for k in want}
    bad = {k: f"{d:.3g}" for k, d in diffs.items() if not d <= atol}
    assert not bad, f"{what}: max |diff| over atol {atol}: {bad}"


def run_two_at_a_time(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each job's result, or the exception it raised (for that job's own test to report);
    two jobs at once, one per core of the machine the suite is sized for."""
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        for name, fut in futures.items():
            try:
                out[name] = fut.result()
            except Exception as e:  # noqa: BLE001
                out[name] = e
    return out


ESTIMATE_RTOL = 0.10  # issue 23: plan=true's estimated peak within 10 % of the measured one
# ... or this many bytes: the reference models of a few KB
ESTIMATE_ATOL = 4096


def late_buffer(estimate: dict[str, Any]) -> int:
    """The bytes a real rank's measured peak may hold above the estimate's: one FSDP collective
    buffer (an all-gather output or a reduce-scatter input, the largest the estimate's step holds).
    A collective's buffer is freed once nothing holds it, the backend's work among them, and on a
    busy machine that can come after the step has gone on to its next allocations (the likely
    cause); the fake step frees it at once.  Seen, each at a load well above the cores: +976 B on
    one rank of unit_param at dim 16 (a 9 KB peak); +2260 B on one of composite's 8 ranks on 2x4
    at dim 16 (15 KB); +89280 B there at dim 100 (a 564 KB peak, whose largest buffer is a
    126048 B reduce-scatter input)."""
    breakdown = estimate.get("breakdown") or {}
    return max(int(breakdown.get("all_gather_buffers", 0)), int(breakdown.get("reduce_scatter_buffers", 0)))


def check_estimate(estimate: dict[str, Any], summary: dict[str, Any], what: str) -> list[float]:
    """plan=true's estimated peak per rank against what each rank measured on its tracked step
    (summary.json's measured_peak_bytes_per_rank): within ESTIMATE_RTOL (or ESTIMATE_ATOL), and a
    measured peak above it by at most one collective buffer more (`late_buffer`); the ratios."""
    measured = summary["measured_peak_bytes_per_rank"]
    estimated = estimate["peak_bytes_per_rank"]
    assert len(measured) == len(estimated), what
    ratios = [e / m for e, m in zip(estimated, measured, strict=True)]
    late = late_buffer(estimate)
    bad = [f"rank {r}: estimated {e}, measured {m}" for r, (e, m) in enumerate(zip(estimated, measured, strict=True))
           if abs(e - m) > max(ESTIMATE_RTOL * m, ESTIMATE_ATOL) + (late if m > e else 0)]  # fmt: skip
    assert not bad, f"{what}: {bad} (a late collective buffer allowed: {late} B)"
    return ratios


def check_plan(run: Path, summary: dict[str, Any], comm: dict[str, int] | None, ov: list[str], steps: int) -> None:
    """A real run's plan against what it did: what the plan says each rank holds is what each
    rank measured holding; the bytes of every collective (FSDP's, and tensor parallelism's:
    `comm`, counted in the ranks over `steps` steps) are the plan's; plan=true (the fake process
    group, one process) writes the very same plan.json; and its estimate of every rank's peak
    (one step on fake tensors) is within ESTIMATE_RTOL of what each rank measured on a real step."""
    from composerun.parallel.planner import plan_offline

    plan = json.loads((run / "plan.json").read_text())
    assert plan["bytes_per_rank"] == summary["measured_bytes_per_rank"], run.name
    if comm is not None:
        want = {k: steps * v for k, v in plan["comm_per_step"].items() if v}
        assert comm == want, f"{run.name}: the ranks sent {comm}, the plan says {want}"
    offline = plan_offline(compose(*ov))[0]
    estimate = offline.pop("estimate")
    assert offline == plan, run.name
    check_estimate(estimate, summary, run.name)
