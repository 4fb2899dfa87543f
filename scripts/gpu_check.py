"""One prepared GPU check: on a machine with a CUDA GPU, its own torch and no network, install
composerun from the working tree and the wheels carried beside it, then, each item a process of
its own with its own time limit (one that fails or hangs costs only itself):

1. the pytest tests that need a CUDA GPU (a `skipif` whose reason names CUDA or a GPU), among
   them async checkpoints equal to sync ones, bit for bit, on the GPU;
2. composerun's `llama3_1b` on one GPU in bf16 (fp32 master weights and reduction), eager,
   compiled, compiled + float8, compiled + selective AC: tokens/s, MFU, the allocator's
   max_memory_allocated and max_memory_reserved, each beside its pre-flight estimate (`plan=true`
   on the same command, planned for the GPU found, on the CPU while the GPU trains);
3. torchtitan's Llama 3 1B at the same shape, batch and sequence length, when its wheels are
   carried and it runs on this torch (else the reason it did not).

It writes gpu_check.json, gpu_check.md (the tables, printed last too) and gpu_check.log (the
end of each item's output) into --out, again after every item, so that a check cut short
leaves what it did; installs, run directories and whole logs go to --work (a temp dir).

    scripts/gpu_check_wheels.sh                        # here, once: the wheels into .whl/
    python3 scripts/gpu_check.py --out "$OUT"          # there, .whl carried with the tree
    python scripts/gpu_check.py --dry-run --out DIR    # anywhere: the plumbing, on the CPU

The whole check keeps to --budget-s (450 s): an item is given what is left of it at most, and
one that cannot start in time is reported skipped.  `--dry-run` runs the same steps on the CPU
with llama3_debug, a few steps and dynamo's eager backend for the compiled cases; the CUDA-only
items (float8, torchtitan) are reported as skipped with the reason, and the CUDA tests are
collected and skip.  Exit status 1 when an item failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gpu_check_report as report
import gpu_check_torchtitan
from gpu_check_runs import CASES, Case, Shape, outcome, plan_overrides, read_estimate, read_run, run, skipped

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"  # scripts/gpu_check_wheels.sh fills it; .whl/torchtitan/ holds torchtitan's
# the test that compares async checkpoints with sync ones on the GPU (tests/test_async_checkpoint.py)
ASYNC_TEST = "test_async_checkpoint_equals_sync"
MIN_START_S = 20  # an item is not started with less of the budget left than this
# each item's limit (s) on a GPU; the budget's remainder cuts them further
LIMITS = {"install": 120, "environment": 60, "tests": 180, "run": 150, "plan": 150, "torchtitan": 150}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.total, self.t0 = seconds, time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def limit(self, wanted: float) -> float | None:
        """The time an item may take now, or None when too little of the budget is left to start it."""
        left = self.left()
        return None if left < MIN_START_S else min(wanted, left)


class Check:
    def __init__(self, args: argparse.Namespace, shape: Shape) -> None:
        self.args, self.dry, self.shape = args, args.dry_run, shape
        self.work, self.out = args.work.resolve(), args.out.resolve()
        self.site = self.work / "site"
        self.budget = Budget(args.budget_s)
        self.items: list[dict[str, Any]] = []
        self.env_info: dict[str, Any] = {}
        # the CPU's items are small; their limits still catch a hang, stretched where the CPU is
        # shared (a dry run beside other work must not time out for that)
        scale = 1.0 if not self.dry else 0.6 * _load_factor()
        self.limits = {k: v * scale for k, v in LIMITS.items()}
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.site), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            "HYDRA_FULL_ERROR": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(self.work / "inductor"),  # a cold cache: compile time as a user's first run
        }
        # -P: never the checkout's ./composerun before the installed one: the check is of the install
        self.py = [sys.executable, "-P"]

    def limit(self, kind: str) -> float | None:
        return self.budget.limit(self.limits[kind])

    # 1. composerun and the carried wheels into a directory of their own
    def install(self) -> None:
        name, timeout = "install", self.limit("install")
        shutil.rmtree(self.site, ignore_errors=True)
        wheels = sorted(WHEELS.glob("*.whl"))
        src = self.work / "src"  # a copy: setuptools writes build/ and egg-info beside the sources
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(REPO / "composerun", src / "composerun", ignore=shutil.ignore_patterns("__pycache__"))
        for part in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / part, src / part)
        # one pip for all (a second --target install into the same directory leaves its bin/ out)
        pip = [*self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        steps = [[*pip, "--no-build-isolation", "--target", str(self.site), *map(str, wheels), str(src)]]
        # what the runs import from there (a missing wheel shows here, not in every run)
        probe = "import composerun, composerun.configs, hydra, omegaconf; print(composerun.__file__)"
        steps.append([*self.py, "-c", probe])
        log = self.work / "logs" / "install.log"
        res = self._steps(steps, log, timeout or 1)
        item = outcome(name, "install", res, timeout, wheels=[w.name for w in wheels])
        notes = [] if wheels else ["no .whl/ here: hydra and omegaconf come from this environment"]
        if item["status"] == "failed" and not res["timed_out"] and res["failed_step"] == 0:
            # pip could not build composerun here (an old setuptools, say): the wheels alone, and
            # composerun copied as it is (its configs/ inside the package)
            shutil.rmtree(self.site, ignore_errors=True)
            steps = [[*pip, "--target", str(self.site), *map(str, wheels)]] if wheels else []
            _copy_package(src, self.site)
            first = res["seconds"]
            res = self._steps([*steps, [*self.py, "-c", probe]], log, self.limit("install") or 1, append=True)
            res["seconds"] = round(res["seconds"] + first, 1)
            item = outcome(name, "install", res, timeout, wheels=[w.name for w in wheels])
            notes.append("composerun copied into place: pip could not build it here (gpu_check.log)")
        if notes:
            item["note"] = "; ".join(notes)
        self.add(item)
        if item["status"] == "ok" and not self.dry:
            self._console_scripts()

    def _steps(self, steps: list[list[str]], log: Path, timeout: float, append: bool = False) -> dict[str, Any]:
        """Commands one after the other into one log, up to the first that fails."""
        res: dict[str, Any] = {"rc": 0, "timed_out": False, "seconds": 0.0, "log": str(log), "failed_step": None}
        if not append:
            log.unlink(missing_ok=True)
        for i, cmd in enumerate(steps):
            part = run(cmd, log.with_suffix(f".{i}.log"), timeout, self.env, self.work)
            res.update(rc=part["rc"], timed_out=part["timed_out"], seconds=round(res["seconds"] + part["seconds"], 1))
            with open(log, "a") as f:
                f.write(Path(part["log"]).read_text(errors="replace"))
            if part["rc"] or part["timed_out"]:
                res["failed_step"] = i
                break
        return res

    def _console_scripts(self) -> None:
        """Tests start `composerun` from beside the interpreter (where an install puts it): the
        installed console scripts go there where this interpreter has none."""
        here = Path(sys.executable).parent
        for script in (self.site / "bin").glob("*"):
            if not (here / script.name).exists():
                shutil.copy2(script, here / script.name)

    # 2. what this machine is: the GPU, torch, the versions the runs use
    def environment(self) -> None:
        code = (
            "import json, platform, torch, importlib.metadata as md\n"
            "from composerun.devices import find_device\n"
            "cuda = torch.cuda.is_available()\n"
            "name = torch.cuda.get_device_name() if cuda else None\n"
            "props = torch.cuda.get_device_properties(0) if cuda else None\n"
            "def ver(p):\n"
            "    try: return md.version(p)\n"
            "    except md.PackageNotFoundError: return None\n"
            "known = find_device(name) if name else None\n"
            "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__,\n"
            "  'cuda': torch.version.cuda, 'gpu': name, 'plan_device': known.name if known else None,\n"
            "  'capability': list(torch.cuda.get_device_capability()) if cuda else None,\n"
            "  'memory_bytes': props.total_memory if cuda else None,\n"
            "  'versions': {p: ver(p) for p in ('composerun', 'hydra-core', 'omegaconf', 'torchao', 'pytest',\n"
            "               'pytest-timeout', 'transformers', 'triton', 'numpy')}}))\n"
        )
        log, timeout = self.work / "logs" / "environment.log", self.limit("environment")
        res = run([*self.py, "-c", code], log, timeout or 1, self.env, self.work)
        item = outcome("environment", "install", res, timeout)
        if item["status"] == "ok":
            # the probe's one JSON line (warnings of the imports may come before or after it)
            self.env_info = json.loads([ln for ln in log.read_text().splitlines() if ln.startswith("{")][-1])
            item["versions"] = self.env_info.get("versions")
        self.env_info["commit"] = _git("rev-parse", "--short", "HEAD")
        self.env_info["tree_changed"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
        self.add(item)

    # 3. the pytest tests that need CUDA (collected and skipped on a CPU)
    def tests(self) -> None:
        files = [
            p
            for p in sorted((REPO / "tests").glob("test_*.py"))
            if p.name != "test_gpu_check.py" and _needs_gpu(p.read_text(errors="replace"))  # (this check's own test)
        ]
        timeout = self.limit("tests")
        if not files or timeout is None:
            self.add(
                skipped(
                    "CUDA tests", "tests", "no test file marks a test as needing CUDA" if not files else "budget spent"
                )
            )
            return
        xml = self.work / "pytest.xml"
        cmd = [*self.py, "-m", "pytest", "-p", "gpu_check_pytest", "-q", "-rA", f"--junitxml={xml}"]
        # in one process, without the repository's addopts (`-n auto`): the GPU machine's python may
        # have no pytest-xdist, and on a CPU the tests only skip, each xdist worker importing torch again
        cmd += ["-o", "addopts=", "-p", "no:xdist"]
        if (self.env_info.get("versions") or {}).get("pytest-timeout"):
            # one test that hangs (a collective, say) fails alone; the others and the XML still come
            cmd.append(f"--timeout={int(self.limits['tests'] * 2 / 3)}")
        res = run(
            cmd + [str(p.relative_to(REPO)) for p in files], self.work / "logs" / "tests.log", timeout, self.env, REPO
        )
        cases = report.junit_cases(xml) if xml.is_file() else []
        counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
        item = outcome("CUDA tests", "tests", res, timeout, files=[p.name for p in files], cases=cases, counts=counts)
        if item["status"] == "ok" and cases and counts["skipped"] == len(cases):
            item.update(status="skipped", reason=cases[0]["message"] or "skipped")
        self.add(item)
        # its own row: the test that saves async and sync checkpoints on the GPU and compares them
        mine = [c for c in cases if ASYNC_TEST in c["name"]]
        item = {"name": "async checkpoint == sync", "kind": "check", "status": "failed"}
        if not mine:
            item["reason"] = f"{ASYNC_TEST}* was not among the tests run"
        else:
            c = mine[0]
            status = {"passed": "ok", "skipped": "skipped"}.get(c["outcome"], "failed")
            item.update(status=status, reason=c["message"], seconds=c["seconds"], test=c["name"])
        self.add(item)

    # 4. the runs, with their estimates planned beside them (on the CPU, while the GPU trains)
    def runs(self, shape: Shape) -> None:
        plan_device = self.env_info.get("plan_device") or ("H100" if self.dry else None)
        mem = self.env_info.get("memory_bytes")
        workers = 2 if self.dry else len(CASES)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            plans = {
                c.name: pool.submit(self._plan, c, shape, plan_device, mem / 2**30 if mem else None) for c in CASES
            }
            for case in CASES:
                item = self._run(case, shape)
                item["estimate"] = plans[case.name].result()
                self.add(item)

    def _float8_missing(self) -> str | None:
        cap = self.env_info.get("capability")
        if self.dry:
            return "float8 trains on a CUDA GPU of compute capability >= 8.9 (dry run on the CPU)"
        if not cap:
            return "no CUDA GPU seen (the environment item)"
        if tuple(cap) < (8, 9):
            return f"float8 needs compute capability >= 8.9; this GPU has {cap[0]}.{cap[1]}"
        return None

    def _run(self, case: Case, shape: Shape) -> dict[str, Any]:
        slug = re.sub(r"[^a-z0-9]+", "_", case.name.lower())
        cmd_args = case.overrides(shape)
        base = {"command": "composerun " + " ".join(cmd_args)}
        missing = self._float8_missing() if case.needs_float8 else None
        timeout = self.limit("run")
        if missing or timeout is None:
            return {**skipped(case.name, "run", missing or "budget spent"), **base}
        run_dir = self.work / "runs" / slug
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [*self.py, "-m", "composerun", *cmd_args, f"hydra.run.dir={run_dir}"]
        res = run(cmd, self.work / "logs" / f"run_{slug}.log", timeout, self.env, self.work)
        item = outcome(case.name, "run", res, timeout, **base)
        if item["status"] == "ok":
            try:
                item.update(read_run(run_dir, shape))
            except (OSError, KeyError, ValueError) as e:
                item.update(status="failed", reason=f"its run directory cannot be read: {e!r}")
            if item["status"] == "ok" and item.get("tokens_per_s") is None:
                item.update(status="failed", reason="no steady-state interval logged (more train.steps)")
        return item

    def _plan(self, case: Case, shape: Shape, plan_device: str | None, memory_gib: float | None) -> dict[str, Any]:
        slug = re.sub(r"[^a-z0-9]+", "_", case.name.lower())
        plan_dir = self.work / "plans" / slug
        shutil.rmtree(plan_dir, ignore_errors=True)
        timeout = self.limit("plan")
        if timeout is None:
            return {"status": "skipped", "reason": "budget spent"}
        cmd = [
            *self.py,
            "-m",
            "composerun",
            *plan_overrides(case, shape, plan_device, memory_gib),
            f"hydra.run.dir={plan_dir}",
        ]
        res = outcome(
            "plan", "plan", run(cmd, self.work / "logs" / f"plan_{slug}.log", timeout, self.env, self.work), timeout
        )
        out = {"status": res["status"], "reason": res["reason"], "seconds": res["seconds"], "log": res["log"]}
        if res["status"] == "ok":
            try:
                out.update(read_estimate(plan_dir))
            except (OSError, KeyError, ValueError, IndexError) as e:
                out.update(status="failed", reason=f"plan.json has no estimate: {e!r}")
        return out

    # 5. torchtitan at the same shape (scripts/gpu_check_torchtitan.py)
    def torchtitan(self, shape: Shape) -> None:
        self.add(gpu_check_torchtitan.item(self, shape))

    def add(self, item: dict[str, Any]) -> None:
        """An item done: a line now, and the files rewritten (a check cut short still leaves them)."""
        self.items.append(item)
        why = f": {item['reason']}" if item.get("reason") and item["status"] != "ok" else ""
        print(f"gpu_check: {item['name']}: {item['status']} ({item.get('seconds', 0)} s){why}", flush=True)
        self.write()

    def write(self, final: bool = False) -> int:
        """gpu_check.json, gpu_check.md (printed when final) and gpu_check.log into --out; 1 if an item failed."""
        self.out.mkdir(parents=True, exist_ok=True)
        data = {
            "dry_run": self.dry,
            "finished": final,
            "wall_s": round(time.monotonic() - self.budget.t0, 1),
            "budget_s": self.args.budget_s,
            "work": str(self.work),
            "environment": self.env_info,
            "shape": {**self.shape.__dict__},
            "items": self.items,
        }
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1) + "\n")
        table = report.markdown(data)
        (self.out / "gpu_check.md").write_text(table)
        (self.out / "gpu_check.log").write_text(report.log_tails(self.items))
        if final:
            print(table, flush=True)
        return 1 if any(i["status"] == "failed" for i in self.items) else 0


def _copy_package(src: Path, site: Path) -> None:
    """composerun as an install lays it out: the package, its configs/ inside it."""
    shutil.copytree(src / "composerun", site / "composerun", dirs_exist_ok=True)


def _load_factor() -> float:
    """How many times over the CPU is taken (1 on an idle machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, os.getloadavg()[0] / cores)


def _needs_gpu(text: str) -> bool:
    """A test file that marks a test as needing CUDA (skipif ..., reason naming CUDA or a GPU)."""
    return re.search(r"skipif\((?:(?!\)\s*\n).){0,300}?\b(cuda|gpu)\b", text, re.I | re.S) is not None


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU: llama3_debug, a few steps")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="gpu_check.json, .md and .log go here")
    p.add_argument("--work", type=Path, default=None, help="installs, run directories, logs (default: a new temp dir)")
    p.add_argument("--budget-s", type=float, default=450, help="the whole check's time; items past it are skipped")
    p.add_argument("--model", default=None, help="model preset (default: llama3_1b; llama3_debug in a dry run)")
    p.add_argument("--batch", type=int, default=4, help="global batch (one GPU: one micro-batch)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: 20; 4 in a dry run)")
    p.add_argument("--log-every", type=int, default=None, help="steps between host reads (default: 5; 2 dry)")
    args = p.parse_args(argv)
    # never under --out: the device machine sends back a few files from there, not a tree of runs
    args.work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    steps = args.steps or (4 if args.dry_run else 20)
    shape = Shape(
        model=args.model or ("llama3_debug" if args.dry_run else "llama3_1b"),
        batch=args.batch,
        steps=steps,
        log_every=args.log_every or (2 if args.dry_run else 5),
        device="cpu" if args.dry_run else "cuda",
        compile_backend="eager" if args.dry_run else "inductor",
    )
    check = Check(args, shape)
    check.work.mkdir(parents=True, exist_ok=True)
    check.install()
    if check.items[-1]["status"] == "ok":
        check.environment()
        check.tests()
        check.runs(shape)
        check.torchtitan(shape)
    return check.write(final=True)


if __name__ == "__main__":
    sys.exit(main())
