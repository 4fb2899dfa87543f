"""CPU benchmark: composerun against a hand-written torchrun + FSDP2 script, in one invocation.

    python scripts/bench_cpu.py --out bench-cpu --update-repo   # full run: BENCHMARKS.md, benchmarks/cpu.json
    python scripts/bench_cpu.py --smoke --out /tmp/smoke         # seconds-to-a-minute; writes only under --out

Both sides run as a user runs them, in subprocesses: `composerun +model=composite ...` (the
console script, self-launching its ranks) and `torchrun --standalone scripts/handwritten_fsdp.py`
(see that file for what it does and why it is the same work).  Runs of the two sides
alternate, --repeats times, the side that goes first alternating between repeats, and every
figure is the median over the repeats of one ratio per repeat, so that the drift of a shared
machine hits both sides alike.

Measured, composerun / hand-written unless said otherwise:
- step time: median wall time per step (step start to after zero_grad, optimizer step
  included) over the steps after --warmup, composite at two widths on meshes 2 and 2x4,
  policy fsdp, the same work on both sides: the hand-written script with composerun's default
  features added (SAME_WORK; scripts/bench_defaults.py sets composerun's defaults against
  the minimal script, and measures each feature);
- start-up: from just before Popen to the end of the first step (each side writes the
  wall clock of its first step's end), mesh 2x4, taken from the step-time runs;
- checkpoint save and load of a >= 1 GiB state (model + AdamW state) on 2 ranks against
  plain dcp.save/dcp.load, and both against this disk's fsync'd write and read bandwidth
  measured in the same run.  Loads and the read bandwidth are cold: the files are dropped
  from the page cache first (posix_fadvise DONTNEED; no root needed), as on a fresh node,
  after one read from the disk (`prime`); and against a bare read of the same files;
- async checkpoint stall (checkpoint.async=true: the save call plus the next step's wait for
  the staged copy) / sync save, same state;
- per-rank bytes of params + grads + optimizer state on N ranks / (1-rank bytes / N).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HANDWRITTEN = REPO / "scripts" / "handwritten_fsdp.py"
TARGETS = {  # ratio keys and the value each must not exceed (or reach, for bandwidth)
    "step_time": ("<=", 1.02),
    "startup": ("<=", 0.5),
    "ckpt_save_vs_dcp": ("<=", 1.05),
    "ckpt_load_vs_dcp": ("<=", 1.05),
    "ckpt_cold_load_vs_dcp": ("<=", 1.05),
    "ckpt_save_vs_disk": (">=", 0.8),
    "ckpt_load_vs_disk": (">=", 0.8),
    "async_stall_vs_sync_save": ("<=", 0.1),
    "memory": ("<=", 1.05),
}
# "more_repeats": cases repeated that many times as often.  A dim-100 step on 2 ranks is ~35 ms,
# and the median step of one 300-step run moved by +-8% from run to run here (either side,
# same command), so one ratio per repeat needs many repeats to resolve a 2% target.
FULL = {
    "dims": [100, 2048],
    "meshes": ["2", "2x4"],
    "steps": {100: 300, 2048: 12},
    "warmup": 3,
    "ckpt_dim": 4096,
    "more_repeats": {"d100_m2": 3},
}
SMOKE = {"dims": [16], "meshes": ["2"], "steps": {16: 4}, "warmup": 1, "ckpt_dim": 64}


def composerun_bin() -> list[str]:
    exe = Path(sys.executable).with_name("composerun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "composerun"]


def torchrun_bin() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def world_of(mesh: str) -> int:
    return math.prod(int(x) for x in mesh.split("x"))


def run(cmd: list[str], log: Path, fresh: Path | None = None, timeout: float = 900) -> float:
    """Run cmd; returns time.time() taken just before Popen.  A run that fails is run once more,
    `fresh` (its run directory) removed first (gloo ranks have been seen to abort at exit,
    after their work: "terminate called without an active exception"); a second failure
    stops the benchmark."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("OMP_NUM_THREADS", None)  # both launchers pick 1 thread per rank here (cores // ranks)
    for attempt in (1, 2):
        if attempt == 2 and fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        with open(log, "w") as f:
            t0 = time.time()
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=log.parent)
        if proc.returncode == 0:
            return t0
        failed = log.with_name(f"{log.name}.failed-{attempt}")
        log.replace(failed)
        print(f"bench_cpu: failed ({proc.returncode}), see {failed}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    raise SystemExit(f"bench_cpu: failed twice: {' '.join(cmd)}\n{failed.read_text()[-3000:]}")


def composerun(run_dir: Path, mesh: str, dim: int, steps: int, *extra: str) -> tuple[float, dict, list[dict]]:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        *composerun_bin(), "+model=composite", f"model.dim={dim}", f"mesh={mesh}", "sharding=fsdp",
        f"train.steps={steps}", "train.log_every=1", "metrics.progress=false", f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip
    t0 = run(cmd, run_dir.parent / f"{run_dir.name}.log", fresh=run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return t0, summary, rows


# what the hand-written script adds to its minimal form to do composerun's default work: the loss
# all-reduced every step (train.log_every=1), clipping at 1.0 (optim.grad_clip), fused AdamW
# (composerun/configs/optim/adamw.yaml), deterministic algorithms without the fill (train.deterministic on CPU)
SAME_WORK = ("--log-every=1", "--clip=1.0", "--fused", "--deterministic=on")


def handwritten(out: Path, mesh: str, dim: int, steps: int, *extra: str) -> tuple[float, dict]:
    """The hand-written script; minimal unless `extra` adds composerun's features (SAME_WORK)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        *torchrun_bin(), "--standalone", f"--nproc_per_node={world_of(mesh)}", str(HANDWRITTEN),
        f"--dim={dim}", f"--steps={steps}", f"--out={out}", *extra,
    ]  # fmt: skip
    t0 = run(cmd, out.with_suffix(".log"))
    return t0, json.loads(out.read_text())


def max_rank_bytes(measured: dict[str, list[int]]) -> int:
    return max(sum(measured[k][r] for k in ("params", "grads", "optim")) for r in range(len(measured["params"])))


# --- the measurements ------------------------------------------------------------------------


def bench_steps(p: dict, repeats: int, work: Path) -> dict:
    cases, startup, memory = {}, [], {}
    one_rank = {}
    for dim in p["dims"]:
        # the 1-rank reference for the memory ratio
        _, s, _ = composerun(work / f"mem1_d{dim}", "1", dim, 2, "checkpoint=none")
        one_rank[dim] = max_rank_bytes(s["measured_bytes_per_rank"])
    for dim in p["dims"]:
        for mesh in p["meshes"]:
            steps, w = p["steps"][dim], p["warmup"]
            c_med, h_med, ratios, losses = [], [], [], []
            for r in range(repeats * p.get("more_repeats", {}).get(f"d{dim}_m{mesh}", 1)):
                name = f"d{dim}_m{mesh}_r{r}"
                # the side that goes first alternates between repeats, as for the checkpoints
                if r % 2:
                    t0h, h = handwritten(work / f"hw_{name}.json", mesh, dim, steps, *SAME_WORK)
                t0c, s, rows = composerun(work / f"cr_{name}", mesh, dim, steps, "checkpoint=none")
                if not r % 2:
                    t0h, h = handwritten(work / f"hw_{name}.json", mesh, dim, steps, *SAME_WORK)
                c = statistics.median(row["step_s"] for row in rows[w:])
                hw = statistics.median(h["step_s"][w:])
                c_med.append(c)
                h_med.append(hw)
                ratios.append(c / hw)
                losses.append((rows[0]["loss"], h["losses"]["1"], rows[-1]["loss"], h["losses"][str(steps)]))
                if mesh == p["meshes"][-1] and dim == p["dims"][0]:
                    startup.append(
                        {
                            "composerun_s": s["first_step_end_unix"] - t0c,
                            "handwritten_s": h["first_step_end_unix"] - t0h,
                        }
                    )
                if r == 0:
                    n = world_of(mesh)
                    memory[f"d{dim}_m{mesh}"] = {
                        "ranks": n,
                        "bytes_max_rank": max_rank_bytes(s["measured_bytes_per_rank"]),
                        "bytes_one_rank": one_rank[dim],
                        "ratio": max_rank_bytes(s["measured_bytes_per_rank"]) / (one_rank[dim] / n),
                    }
            cases[f"d{dim}_m{mesh}"] = {
                "dim": dim,
                "mesh": mesh,
                "steps": steps,
                "warmup_excluded": w,
                "composerun_median_step_s": statistics.median(c_med),
                "handwritten_median_step_s": statistics.median(h_med),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                # identical work: the same first and last losses, bit for bit
                "same_losses": all(a == b and c == d for a, b, c, d in losses),
            }
    for s in startup:
        s["ratio"] = s["composerun_s"] / s["handwritten_s"]
    return {"step_time": cases, "startup": startup, "memory": memory}


def evict(path: Path) -> None:
    """Drop a file (or a folder's files) from the page cache: the next read comes from the disk.
    Works without root for clean pages (the files were fsync'd)."""
    for f in [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prime(path: Path) -> None:
    """Read a checkpoint's files once from the disk and drop them from the page cache again.
    On this VM the first read of files written seconds before is slower than every later
    one (BENCHMARKS.md: 1.3-1.6 s against 0.9-1.1 s for the same cold resume), so every
    cold load here, each side's, reads files the disk has read once before."""
    evict(path)
    buf = bytearray(16 << 20)
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    evict(path)


def _distinct_bytes(nbytes: int) -> bytearray:
    """nbytes of data no 4 KiB block of which repeats, as in a checkpoint: a random pool,
    repeated, with each block's first 8 bytes set to its index, so that neither a storage
    layer that dedups or compresses nor a source that stays in the CPU's cache makes the
    probe faster than a checkpoint could be."""
    pool = os.urandom(64 << 20)
    buf = bytearray(pool * -(-nbytes // len(pool)))[:nbytes]
    import torch

    blocks = torch.frombuffer(buf, dtype=torch.int64, count=(nbytes // 4096) * 512).view(-1, 512)
    blocks[:, 0] = torch.arange(blocks.shape[0])
    return buf


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o644)


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy (user, nice, system, irq, softirq) since
    boot, from /proc/stat; 0.0 where there is none."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _io(paths: list[Path], data: bytearray, direct: bool, write: bool, new_memory: bool = False) -> float:
    """Seconds to write `data` (fsync'd) into, or read it back from, len(paths) files at
    once, one thread each, 16 MiB a call (O_DIRECT through aligned buffers when direct).
    A read with new_memory reads each file into memory made for it, as a resume reads the
    optimizer's state, instead of into one 16 MiB buffer used again and again."""
    import mmap
    import threading

    chunk, part = 16 << 20, len(data) // len(paths) // (16 << 20) * (16 << 20)

    def one(i: int) -> None:
        view = memoryview(data)[i * part : (i + 1) * part]
        buf = mmap.mmap(-1, part if new_memory else chunk)  # page-aligned, as O_DIRECT wants
        into = memoryview(buf)
        fd = _open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY, direct)
        try:
            for at in range(0, part, chunk):
                if write:
                    buf[:] = view[at : at + chunk]
                    os.write(fd, buf)
                else:
                    os.readv(fd, [into[at : at + chunk] if new_memory else into])
            if write:
                os.fsync(fd)
        finally:
            os.close(fd)
            into.release()
            buf.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def disk_bandwidth(work: Path, nbytes: int, streams: int = 2) -> dict:
    """The disk's fsync'd write and cold read bandwidth for nbytes of distinct data: each of
    1 and `streams` files at once (the checkpoint's ranks), through the page cache and with
    O_DIRECT; the best of them is the disk's.  Then a page-cached read, and a cold read of the
    `streams` files into new memory; for the two cold reads of `streams` files through the
    page cache, the CPU-seconds the machine was busy."""
    size = max(1, nbytes // streams // (16 << 20)) * (16 << 20) * streams  # whole 16 MiB calls per file
    data = _distinct_bytes(size)
    out: dict = {"bytes": size, "write": {}, "read": {}}
    for direct in (False, True):
        for n in (1, streams):
            name = f"{'direct' if direct else 'page_cache'}_{n}"
            paths = [work / f"disk_probe_{i}.bin" for i in range(n)]
            os.sync()
            out["write"][name] = size / _io(paths, data, direct, write=True)
            for p in paths:
                evict(p)
            cpu0 = busy_cpu_s()
            out["read"][name] = size / _io(paths, data, direct, write=False)
            if name == f"page_cache_{streams}":
                out["read_busy_cpu_s"] = busy_cpu_s() - cpu0
                out["cached_read_Bps"] = size / _io(paths, data, False, write=False)
                for p in paths:
                    evict(p)
                cpu0 = busy_cpu_s()
                out["read_new_memory_Bps"] = size / _io(paths, data, False, write=False, new_memory=True)
                out["read_new_memory_busy_cpu_s"] = busy_cpu_s() - cpu0
            for p in paths:
                p.unlink()
    out["write_Bps"] = max(out["write"].values())
    out["read_Bps"] = max(out["read"].values())
    return out


# Of a checkpoint of model + AdamW state, the share a resume reads into memory it makes anew:
# AdamW's two moments per parameter (the parameters exist before the load).
_NEW_SHARE = 2 / 3


def _bare_read(path: Path, touch_first: bool, start: Any, out: Any) -> None:
    """One process of `bare_load`: read `path`, 16 MiB a call, into memory as a resume has it:
    the first third into memory in use before (the model's parameters), the rest into new
    memory (the optimizer's state), made after the start."""
    import ctypes
    import mmap
    import threading

    size, chunk = path.stat().st_size, 16 << 20
    old = size - int(size * _NEW_SHARE) // 4096 * 4096
    before = mmap.mmap(-1, max(old, 1))
    before.write(b"\1" * old)  # touched: memory in use before the load
    fd = os.open(path, os.O_RDONLY)
    start.wait()
    t0 = time.perf_counter()
    new = mmap.mmap(-1, max(size - old, 1))
    if touch_first:  # the kernel reads ahead while the new memory is touched, as a resume does

        def ahead() -> None:
            for at in range(0, size, 8 << 20):
                os.posix_fadvise(fd, at, 8 << 20, os.POSIX_FADV_WILLNEED)

        reader = threading.Thread(target=ahead)
        reader.start()
        head = ctypes.c_char.from_buffer(new)
        ctypes.memset(ctypes.addressof(head), 0, size - old)
        del head
    for at, mem, end in ((0, before, old), (old, new, size)):
        view = memoryview(mem)
        for pos in range(at, end, chunk):
            os.preadv(fd, [view[pos - at : min(pos + chunk, end) - at]], pos)
        view.release()
    if touch_first:
        reader.join()
    out.put(time.perf_counter() - t0)
    before.close()
    new.close()
    os.close(fd)


def bare_load(ckpt: Path) -> dict:
    """The least a cold load of `ckpt` takes here with nothing but reads: one process per data
    file (one per rank), all started at once, each reading its file from the disk into memory
    as a resume has it (the model's third into memory in use before, AdamW's two thirds into
    new memory), nothing else (no DCP, no checks, no tensors).  Two ways, the files dropped
    from the page cache before each: a plain read, and touching the new memory while the
    kernel reads ahead; the faster is the bare load.  Seconds: the slowest process of each."""
    import multiprocessing

    files = sorted(ckpt.glob("*.distcp"))
    ctx = multiprocessing.get_context("spawn")  # no copy of this process's pages in the readers
    out: dict = {}
    for name, touch in (("read", False), ("touch_then_read", True)):
        evict(ckpt)
        start, results = ctx.Barrier(len(files) + 1), ctx.Queue()  # the readers and this process
        procs = [ctx.Process(target=_bare_read, args=(f, touch, start, results)) for f in files]
        for proc in procs:
            proc.start()
        start.wait()  # the readers are set up and start reading now
        cpu0 = busy_cpu_s()
        out[name] = max(results.get(timeout=600) for _ in procs)
        out[f"{name}_busy_cpu_s"] = busy_cpu_s() - cpu0
        for proc in procs:
            proc.join()
    out["best_s"] = min(out["read"], out["touch_then_read"])
    return out


def bench_checkpoint(p: dict, repeats: int, work: Path) -> dict:
    dim, mesh = p["ckpt_dim"], "2"
    rows = []
    for r in range(repeats):
        hw_dir = work / f"hw_ck_r{r}"
        shutil.rmtree(hw_dir, ignore_errors=True)

        def plain_dcp(r: int = r, hw_dir: Path = hw_dir) -> dict:
            os.sync()  # no earlier run's writeback left to slow this one's fsyncs
            return handwritten(work / f"hw_ck_r{r}.json", mesh, dim, 1, *SAME_WORK, f"--ckpt-dir={hw_dir}")[1]

        if r % 2:  # the side that goes first alternates: drift on the disk hits both alike
            h = plain_dcp()
        # sync save at the end of one step, then a resume of it in a fresh run directory
        save_dir = work / f"ck_save_r{r}"
        os.sync()
        _, _, m = composerun(save_dir, mesh, dim, 1, *(["checkpoint.direct_io=true"] if p is SMOKE else []))
        ckpt = save_dir / "checkpoints" / "step-00000001"
        if p is SMOKE:  # a check that it runs: the sync save's run saves with O_DIRECT and serves both
            md = m
        else:
            direct_dir = work / f"ck_direct_r{r}"  # the same save with O_DIRECT (checkpoint.direct_io=true)
            os.sync()
            _, _, md = composerun(direct_dir, mesh, dim, 1, "checkpoint.direct_io=true")
            shutil.rmtree(direct_dir / "checkpoints", ignore_errors=True)
        nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
        loads = {}
        prime(ckpt)
        bare = bare_load(ckpt) if r % 2 else None  # the bare read goes first every other repeat
        # cold: read from the disk; warm: the pages the cold run left (a smoke's cold run serves both)
        for kind in ("cold",) if p is SMOKE else ("cold", "warm"):
            if kind == "cold":
                evict(ckpt)
            _, loads[kind], lrows = composerun(
                work / f"ck_load_{kind}_r{r}", mesh, dim, 2, f"checkpoint.resume={ckpt}", "checkpoint.at_end=false"
            )
        loads.setdefault("warm", loads["cold"])
        bare = bare or bare_load(ckpt)
        # async: a save after step 1 while steps 2-3 go on
        _, _, ma = composerun(work / f"ck_async_r{r}", mesh, dim, 3, "checkpoint.async=true", "checkpoint.every=1")
        if r % 2 == 0:
            h = plain_dcp()
        disk = disk_bandwidth(work, nbytes)
        row = {
            "checkpoint_bytes": nbytes,
            "handwritten_checkpoint_bytes": h["checkpoint_bytes"],
            "composerun_save_s": m[0]["checkpoint_stall_s"],
            "composerun_direct_save_s": md[0]["checkpoint_stall_s"],
            "composerun_load_s": loads["warm"]["resume_s"],
            "composerun_cold_load_s": loads["cold"]["resume_s"],
            "handwritten_save_s": h["save_s"],
            "handwritten_load_s": h["load_s"],
            "handwritten_cold_load_s": h["cold_load_s"],
            "bare_cold_load_s": bare["best_s"],
            "bare_cold_load": bare,
            # the save call, plus step 2's wait for the staged copy before its optimizer step
            "async_stall_s": ma[0]["checkpoint_stall_s"] + ma[1].get("checkpoint_wait_s", 0.0),
            "async_call_s": ma[0]["checkpoint_stall_s"],
            "async_wait_s": ma[1].get("checkpoint_wait_s", 0.0),
            # step 2 while the save of step 1 runs in the background, against step 2 of a resumed
            # run with no save in flight (the same state and batch)
            "async_step2_s": ma[1]["step_s"],
            "plain_step2_s": lrows[0]["step_s"],
            "disk": disk,
        }
        for d in (save_dir, work / f"ck_async_r{r}", hw_dir):  # a GiB each: keep the disk free
            shutil.rmtree(d / "checkpoints" if d.name.startswith("ck_") else d, ignore_errors=True)
        rows.append(row)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    med_of = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731  (one ratio per repeat)
    return {
        "dim": dim,
        "mesh": mesh,
        "repeats": rows,
        "checkpoint_bytes": med("checkpoint_bytes"),
        "ratios": {
            "ckpt_save_vs_dcp": med_of(lambda r: r["composerun_save_s"] / r["handwritten_save_s"]),
            "ckpt_load_vs_dcp": med_of(lambda r: r["composerun_load_s"] / r["handwritten_load_s"]),
            "ckpt_save_vs_disk": med_of(
                lambda r: r["checkpoint_bytes"] / r["composerun_save_s"] / r["disk"]["write_Bps"]
            ),
            "ckpt_cold_load_vs_dcp": med_of(lambda r: r["composerun_cold_load_s"] / r["handwritten_cold_load_s"]),
            "ckpt_load_vs_disk": med_of(
                lambda r: r["checkpoint_bytes"] / r["composerun_cold_load_s"] / r["disk"]["read_Bps"]
            ),
            "bare_load_vs_disk": med_of(
                lambda r: r["checkpoint_bytes"] / r["bare_cold_load_s"] / r["disk"]["read_Bps"]
            ),
            "ckpt_cold_load_vs_bare": med_of(lambda r: r["composerun_cold_load_s"] / r["bare_cold_load_s"]),
            "disk_read_new_memory_vs_disk": med_of(lambda r: r["disk"]["read_new_memory_Bps"] / r["disk"]["read_Bps"]),
            "direct_save_vs_disk": med_of(
                lambda r: r["checkpoint_bytes"] / r["composerun_direct_save_s"] / r["disk"]["write_Bps"]
            ),
            "dcp_save_vs_disk": med_of(
                lambda r: r["handwritten_checkpoint_bytes"] / r["handwritten_save_s"] / r["disk"]["write_Bps"]
            ),
            "dcp_load_vs_disk": med_of(
                lambda r: r["handwritten_checkpoint_bytes"] / r["handwritten_cold_load_s"] / r["disk"]["read_Bps"]
            ),
            "async_stall_vs_sync_save": med_of(lambda r: r["async_stall_s"] / r["composerun_save_s"]),
        },
    }


# --- the report ----------------------------------------------------------------------------------


def machine() -> dict:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def summarize(result: dict) -> dict:
    st = result["step_time"]
    ratios = {f"step_time_{k}": v["ratio"] for k, v in st.items()}
    ratios["startup"] = statistics.median(s["ratio"] for s in result["startup"])
    ratios.update(result["checkpoint"]["ratios"])
    for k, v in result["memory"].items():
        ratios[f"memory_{k}"] = v["ratio"]
    met = {}
    for key, value in ratios.items():
        base = next((t for t in TARGETS if key == t or key.startswith(t + "_")), None)
        if base is not None:
            op, bound = TARGETS[base]
            met[key] = value <= bound if op == "<=" else value >= bound
    return {"ratios": ratios, "targets": {k: f"{TARGETS[k][0]} {TARGETS[k][1]}" for k in TARGETS}, "met": met}


_PROBE_NAMES = {
    "page_cache_1": "1 file, page cache",
    "page_cache_2": "2 files, page cache",
    "direct_1": "1 file, O_DIRECT",
    "direct_2": "2 files, O_DIRECT",
}


def markdown(result: dict, argv: list[str]) -> str:
    m, rs = result["machine"], result["summary"]
    ck = result["checkpoint"]
    gib = ck["checkpoint_bytes"] / 2**30
    yes = lambda k: "yes" if rs["met"].get(k) else "**no**"  # noqa: E731
    lines = [
        "## CPU: composerun against a hand-written torchrun + FSDP2 script",
        "",
        "```bash",
        "python " + " ".join(["scripts/bench_cpu.py", *argv]),
        "```",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}; load average at the "
        f"start {m['load_avg_at_start'][0]:.1f}. Duration {result['duration_s'] / 60:.1f} min, "
        f"{result['repeats']} repeats. Every figure is the median over the repeats of the per-repeat ratio; the raw "
        "numbers are in `benchmarks/cpu.json`. The two sides run alternately, and which goes first "
        "alternates between repeats, so drift on a shared machine hits both alike.",
        "",
        "What is equal on both sides: torch's CompositeModel with the same seeded initialization, `fully_shard` "
        "on l1, u1, u2, l2 and then the root over every rank (`sharding=fsdp`), the same synthetic samples "
        "(global batch 8), fused AdamW (lr 1e-3, weight decay 0, 2 warm-up steps then cosine), grad-norm clipping at "
        "1.0, the loss all-reduced and recorded every step, torch's deterministic algorithms (without its fill of new "
        "memory, composerun's CPU default since issue 20; runs before it had the fill on both sides), 1 OpenMP "
        "thread per rank, fp32. The hand-written "
        "script re-implements model and data in plain torch (it imports nothing from composerun); "
        "`same losses` says the first and last losses of the two runs are bit for bit equal. What differs: the "
        "hand-written loop all-reduces its loss and then `clip_grad_norm_` all-reduces the gradients' squared "
        "norms; composerun sends both (and its stop flag) in one all-reduce and computes the same norm from it.",
        "",
        "### Step time (median over steps after the warm-up; wall time per step incl. the optimizer step)",
        "",
        "| model.dim | mesh | steps (warm-up excluded) | repeats | composerun | hand-written | ratio | per repeat (min–max) "
        "| target ≤ 1.02 | same losses |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, v in result["step_time"].items():
        lines.append(
            f"| {v['dim']} | {v['mesh']} | {v['steps']} ({v['warmup_excluded']}) | {len(v['ratios'])} | "
            f"{v['composerun_median_step_s'] * 1e3:.1f} ms | {v['handwritten_median_step_s'] * 1e3:.1f} ms | "
            f"{v['ratio']:.3f} | {min(v['ratios']):.2f}–{max(v['ratios']):.2f} | {yes('step_time_' + k)} | {'yes' if v['same_losses'] else '**no**'} |"
        )
    su = result["startup"]
    cs = statistics.median(s["composerun_s"] for s in su)
    hs = statistics.median(s["handwritten_s"] for s in su)
    lines += [
        "",
        "### Start-up: process start to the end of the first step, mesh 2x4",
        "",
        "| composerun (self-launch) | torchrun + hand-written | ratio | target ≤ 0.5 |",
        "|---|---|---|---|",
        f"| {cs:.2f} s | {hs:.2f} s | {rs['ratios']['startup']:.3f} | {yes('startup')} |",
        "",
        f"### Checkpoint: {gib:.2f} GiB (model + AdamW state, model.dim={ck['dim']}), mesh {ck['mesh']}",
        "",
        *(
            [
                "Measured again after the run above, with the same command, `--only-checkpoint` and "
                f"{len(ck['repeats'])} repeats ({result['checkpoint_duration_s'] / 60:.1f} min; load average at its start "
                f"{result['checkpoint_machine']['load_avg_at_start'][0]:.1f}).",
                "",
            ]
            if "checkpoint_duration_s" in result
            else []
        ),
        "composerun's save is the whole `checkpoint_stall_s` of a sync save (DCP write, data files fsync'd, the "
        "manifest with every file's size and xxh3_128 checksum, computed while writing, directory fsyncs, the "
        "atomic rename and `latest`; the files carry no torch.save CRC32s and go out to the disk as they are "
        "written, through a page cache of bounded size: each 32 MiB handed to writeback, the 32 MiB before it "
        "waited for and dropped); its load is the whole resume (the integrity check against the manifest, "
        "the key check, the DCP load through composerun's reader, which reads each whole tensor straight into "
        "place while a background thread has the kernel read the files ahead, and hashes every byte of each rank's "
        "file as it reads it, for the checksums). The plain `dcp.save` is durable for its data "
        "files and `.metadata` (DCP's `sync_files=True`) but not for the directory entries. Cold loads, like the "
        "read bandwidth, read from the disk: the files are dropped from the page cache first (posix_fadvise "
        "DONTNEED); warm loads read the pages a previous read left cached. The disk's bandwidth is the best of "
        "four ways of writing (fsync'd) and then reading back cold the checkpoint's size of distinct data, 16 MiB "
        "a call: one file or two at once (the two ranks), through the page cache or with O_DIRECT (table below). "
        "Both sides use fused AdamW (composerun's default). Before a load, plain DCP's side has the state-dict "
        "utilities create AdamW's state with one zero-gradient step; composerun creates it NaN-filled, for the "
        "load to fill.",
        "",
        "| | composerun | plain DCP | disk (fsync'd write / cold read) | composerun / DCP | target | "
        "composerun / disk | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    r0 = {
        k: statistics.median(r[k] for r in ck["repeats"])
        for k, v in ck["repeats"][0].items()
        if not isinstance(v, dict)
    }
    wbw = statistics.median(r["disk"]["write_Bps"] for r in ck["repeats"]) / 2**30
    rbw = statistics.median(r["disk"]["read_Bps"] for r in ck["repeats"]) / 2**30
    cbw = statistics.median(r["disk"]["cached_read_Bps"] for r in ck["repeats"]) / 2**30
    med_disk = lambda k: statistics.median(r["disk"][k] for r in ck["repeats"])  # noqa: E731
    nbw = med_disk("read_new_memory_Bps") / 2**30
    ratios = rs["ratios"]
    lines += [
        f"| save | {r0['composerun_save_s']:.2f} s | {r0['handwritten_save_s']:.2f} s | {wbw:.2f} GiB/s | "
        f"{ratios['ckpt_save_vs_dcp']:.3f} | ≤ 1.05: {yes('ckpt_save_vs_dcp')} | {ratios['ckpt_save_vs_disk']:.2f} | "
        f"≥ 0.8: {yes('ckpt_save_vs_disk')} |",
        f"| load, cold | {r0['composerun_cold_load_s']:.2f} s | {r0['handwritten_cold_load_s']:.2f} s | "
        f"{rbw:.2f} GiB/s | {ratios['ckpt_cold_load_vs_dcp']:.3f} | ≤ 1.05: {yes('ckpt_cold_load_vs_dcp')} | "
        f"{ratios['ckpt_load_vs_disk']:.2f} | ≥ 0.8: {yes('ckpt_load_vs_disk')} |",
        f"| load, warm (page-cached) | {r0['composerun_load_s']:.2f} s | {r0['handwritten_load_s']:.2f} s | "
        f"{cbw:.2f} GiB/s | {ratios['ckpt_load_vs_dcp']:.3f} | ≤ 1.05: {yes('ckpt_load_vs_dcp')} | | |",
        "",
        f"A bare cold read of the same data files, one process per rank's file, all at once, into memory as a resume "
        f"has it (a third, the model's share, into memory in use before; AdamW's two thirds into new memory; no DCP, "
        f"no tensors, no checks; the faster of a plain read, 16 MiB a call, and touching the new memory while the "
        f"kernel reads the file ahead): {r0['bare_cold_load_s']:.2f} s, {ratios['bare_load_vs_disk']:.2f} of the "
        f"disk. composerun's cold load took {ratios['ckpt_cold_load_vs_bare']:.2f} times as long as the bare read "
        "(median of the per-repeat ratios). The disk's figure is a read into memory used before.",
        "",
        f"The disk's own cold read of both files at once, the same calls, but into new memory (as a resume reads "
        f"AdamW's state) instead of one buffer used again: {nbw:.2f} GiB/s, "
        f"{ratios['disk_read_new_memory_vs_disk']:.2f} of the disk. The machine's CPUs were busy "
        f"{med_disk('read_busy_cpu_s'):.2f} CPU-seconds for the read into the reused buffer and "
        f"{med_disk('read_new_memory_busy_cpu_s'):.2f} for the read into new memory (from /proc/stat; "
        f"{os.cpu_count()} CPUs); during the bare read: "
        f"{statistics.median(r['bare_cold_load']['read_busy_cpu_s'] for r in ck['repeats']):.2f} "
        f"(plain read) and "
        f"{statistics.median(r['bare_cold_load']['touch_then_read_busy_cpu_s'] for r in ck['repeats']):.2f} "
        f"(touch while reading ahead).",
        "",
        f"Plain DCP against the disk: save {ratios['dcp_save_vs_disk']:.2f}, load {ratios['dcp_load_vs_disk']:.2f}. "
        f"composerun's save with `checkpoint.direct_io=true` (O_DIRECT, run right after the one above): "
        f"{r0['composerun_direct_save_s']:.2f} s, {ratios['direct_save_vs_disk']:.2f} of the disk.",
        "",
        "The disk probe, GiB/s (medians over the repeats):",
        "",
        "| | " + " | ".join(_PROBE_NAMES.values()) + " |",
        "|---|" + "---|" * len(_PROBE_NAMES),
        *(
            f"| {what} | "
            + " | ".join(
                f"{statistics.median(r['disk'][what][k] for r in ck['repeats']) / 2**30:.2f}" for k in _PROBE_NAMES
            )
            + " |"
            for what in ("write", "read")
        ),
        "",
        f"Async save (`checkpoint.async=true`): training stalled {r0['async_stall_s']:.3f} s against "
        f"{r0['composerun_save_s']:.2f} s for a sync save: ratio {ratios['async_stall_vs_sync_save']:.3f} "
        f"(target ≤ 0.1: {yes('async_stall_vs_sync_save')}). The stall is the save call "
        f"({r0['async_call_s']:.3f} s: the state dicts and starting the copy) plus the next step's wait for the "
        f"copy before its optimizer step ({r0['async_wait_s']:.3f} s). The copy and the writes run in background "
        f"threads on the same 2 cores, so the step they overlap takes {r0['async_step2_s']:.2f} s against "
        f"{r0['plain_step2_s']:.2f} s for the same step with no save in flight.",
        "",
        "### Memory: per-rank bytes of params + grads + AdamW state (max over ranks) / (1-rank bytes / N)",
        "",
        "| case | ranks | bytes (max rank) | 1-rank bytes | ratio | target ≤ 1.05 |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in result["memory"].items():
        lines.append(
            f"| {k} | {v['ranks']} | {v['bytes_max_rank']:,} | {v['bytes_one_rank']:,} | {v['ratio']:.3f} | "
            f"{yes('memory_' + k)} |"
        )
    return "\n".join(lines) + "\n"


def update_benchmarks_md(section: str) -> None:
    """Replace the CPU section (or the sentence saying there is none) and keep the GPU section."""
    path = REPO / "BENCHMARKS.md"
    text = path.read_text()
    start = text.find("## CPU:")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    else:
        gpu = text.find("## GPU:")
        head = text[:gpu].rstrip()
        cut = head.find(" The CPU benchmarks")
        if cut >= 0:
            head = head[:cut]
        text = head + "\n\n" + section + "\n" + text[gpu:]
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-cpu", help="run folders, cpu.json and cpu.md go here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, mesh 2, one repeat, one save (O_DIRECT) and one load serving two figures each: "
        "a check that it runs",
    )
    ap.add_argument("--update-repo", action="store_true", help="also write benchmarks/cpu.json and BENCHMARKS.md")
    ap.add_argument(
        "--only-checkpoint",
        action="store_true",
        help="measure the checkpoint part again and keep the rest of --out's cpu.json (which it needs)",
    )
    args = ap.parse_args()
    if args.smoke and args.update_repo:
        raise SystemExit("bench_cpu: --smoke figures never go into the repository")
    p = SMOKE if args.smoke else FULL
    repeats = 1 if args.smoke else args.repeats
    out = Path(args.out).resolve()
    if args.only_checkpoint and not (out / "cpu.json").is_file():
        raise SystemExit(
            f"bench_cpu: --only-checkpoint keeps a full run's figures: {out / 'cpu.json'} is missing; run without it first"
        )
    work = out / ("runs-checkpoint" if args.only_checkpoint else "runs")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    t0 = time.perf_counter()
    if args.only_checkpoint:  # the step, start-up and memory figures of the last full run stay
        result = json.loads((out / "cpu.json").read_text())
        result["checkpoint_machine"] = machine()
        result["checkpoint"] = bench_checkpoint(p, repeats, work)
        result["checkpoint_duration_s"] = time.perf_counter() - t0
    else:
        result = {"machine": machine(), "smoke": args.smoke, "repeats": repeats, "params": {**p, "steps": p["steps"]}}
        result.update(bench_steps(p, repeats, work))
        result["checkpoint"] = bench_checkpoint(p, repeats, work)
        result["duration_s"] = time.perf_counter() - t0
    result["summary"] = summarize(result)
    # the command of the full run: a later --only-checkpoint run keeps it for the report
    argv = sys.argv[1:] if not args.only_checkpoint else result.get("argv", sys.argv[1:])
    result["argv"] = argv
    (out / "cpu.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = markdown(result, argv)
    (out / "cpu.md").write_text(md)
    if args.update_repo:
        shutil.copy(out / "cpu.json", REPO / "benchmarks" / "cpu.json")
        update_benchmarks_md(md)
    for k, v in result["summary"]["ratios"].items():
        met = result["summary"]["met"].get(k)
        print(f"{k:32s} {v:8.3f}  {'' if met is None else ('met' if met else 'NOT met')}")
    print(f"bench_cpu: {result['duration_s']:.0f} s; {out / 'cpu.json'}")


if __name__ == "__main__":
    main()
