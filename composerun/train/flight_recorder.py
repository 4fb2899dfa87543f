"""What a rank leaves when a collective hangs: torch's flight recorder (`profile.flight_recorder`:
the last N collectives of every rank, each with its group, sequence number, sizes and Python
stack), its dumps in RUN/flight_recorder/rank_{R}, and the one line the run ends with.  How
long a collective may wait is `launch.collective_timeout` (the process group's timeout).

On a GPU, NCCL's watchdog finds the timeout, writes the dump itself (TORCH_NCCL_DUMP_ON_TIMEOUT,
to TORCH_FR_DUMP_TEMP_FILE + the rank), has the other ranks write theirs, and ends the process:
the launcher's line then names the dumps (`dumps_since`, launch/agent.py).  On gloo the
collective raises in the rank instead; `timed_out` writes the same file in the same format and
asks every other rank for its own (`Watch`: a thread in each rank, which answers while the
rank's main thread waits or sleeps), so that torch's analyzer
(`python -m torch.distributed.flight_recorder.fr_trace RUN/flight_recorder`) has every rank's.

The variables are set in the rank before its process group exists (torch reads them then) and
put back when the run ends: a run inside a process (a test's, a notebook's) leaves the next
one's environment as it found it."""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from composerun import _torch_compat as compat
from composerun.config.schema import Config
from composerun.errors import CollectiveTimeout
from composerun.parallel.mesh import pick_device
from composerun.rundir import RunDir

# The names torch 2.11 to 2.14 read first, for gloo and NCCL alike (the older TORCH_NCCL_TRACE_BUFFER_SIZE
# and TORCH_NCCL_DEBUG_INFO_TEMP_FILE come after them, and warn that they are deprecated).
SIZE_VARS = ("TORCH_FR_BUFFER_SIZE",)
PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE",)
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
POLL_S = 0.5  # how often a rank's Watch looks for a request to dump
GATHER_S = 10.0  # the longest the rank that timed out waits for the others' dumps

# What a collective that waited too long raises: gloo's transport, NCCL's watchdog (in the main
# thread, where it waits on the work).  A store that timed out (start-up) says otherwise.
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms for|collective operation timeout|Watchdog caught collective")


def uses_nccl(cfg: Config) -> bool:
    return "nccl" in pick_device(cfg.mesh)[1]


@contextmanager
def armed(cfg: Config, run_dir: Path) -> Iterator[None]:
    """Keep profile.flight_recorder entries per rank (0: none), dumped into RUN/flight_recorder/
    on a timeout, from the process group made inside this block on.  NCCL's watchdog writes
    there itself, so on a GPU the folder is made now; on a CPU, only when there is a dump."""
    entries = cfg.profile.flight_recorder
    folder = RunDir(run_dir).flight_recorder
    wanted = dict.fromkeys(SIZE_VARS, str(entries))  # 0: none kept (torch keeps some by default)
    if entries:
        wanted |= dict.fromkeys(PREFIX_VARS, str(folder / "rank_")) | {DUMP_ON_TIMEOUT: "1"}
        if uses_nccl(cfg):
            folder.mkdir(parents=True, exist_ok=True)
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _request_key(run_dir: Path) -> str:
    return f"composerun/flight_recorder/dump/{run_dir}"


def _dump(path: Path, nccl: bool) -> None:
    """This rank's dump at `path`, unless one is there (NCCL's watchdog's); whole or not at all."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(compat.flight_recorder_dump(nccl))
    tmp.replace(path)


class Watch:
    """On gloo, with several ranks: a thread that writes this rank's dump when another rank asks
    (its collective timed out), as NCCL's watchdog does on a GPU.  It only polls the store; a
    rank whose main thread waits in a collective or sleeps still answers."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = RunDir(run_dir).flight_recorder / f"rank_{rank}"
        self.key, self.store = _request_key(run_dir), compat.default_store()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="composerun-flight-recorder", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopped.wait(POLL_S):
            try:
                if self.store.check([self.key]):
                    _dump(self.path, nccl=False)
                    return
            except Exception:  # noqa: BLE001 - the store is gone (the run is ending): nothing to answer
                return

    def stop(self) -> None:
        self.stopped.set()


@contextmanager
def watching(cfg: Config, run_dir: Path) -> Iterator[None]:
    """A Watch for this rank while the block runs, where it is needed (see Watch)."""
    if not cfg.profile.flight_recorder or dist.get_world_size() == 1 or uses_nccl(cfg):
        yield
        return
    watch = Watch(run_dir, dist.get_rank())
    try:
        yield
    finally:
        watch.stop()


def timed_out(e: BaseException, cfg: Config, run_dir: Path, rank: int) -> CollectiveTimeout | None:
    """The one line for a collective that timed out on this rank (None for any other error),
    with this rank's flight-recorder dump written where NCCL's watchdog has not written it, and
    (on gloo) the other ranks' asked for and waited for a little."""
    if not isinstance(e, RuntimeError) or not _TIMED_OUT.search(str(e)):
        return None
    after = f"after {cfg.launch.collective_timeout:g} s (launch.collective_timeout)"
    hint = "a slow rank needs a larger launch.collective_timeout"
    if not cfg.profile.flight_recorder:
        return CollectiveTimeout(
            f"a collective timed out on rank {rank} {after}; no flight recorder (profile.flight_recorder=0 "
            f"keeps none); a rank that never joined it is stuck or dead (its rank{{R}}.log says where), {hint}"
        )
    folder = RunDir(run_dir).flight_recorder
    try:
        _dump(folder / f"rank_{rank}", uses_nccl(cfg))
        mine = pickle.loads((folder / f"rank_{rank}").read_bytes())
        behind = _gather(cfg, run_dir, mine)
    except Exception as failed:  # noqa: BLE001 - the timeout is the error to report
        return CollectiveTimeout(
            f"a collective timed out on rank {rank} {after}; no flight-recorder dump ({type(failed).__name__}: "
            f"{failed}); {hint}"
        )
    analyzer = ""
    if uses_nccl(cfg) or compat.analyzer_reads_gloo():
        analyzer = f" (python -m torch.distributed.flight_recorder.fr_trace {folder} matches them up)"
    return CollectiveTimeout(
        f"a collective timed out on rank {rank} {after}{_describe(mine)}; {behind}; the flight recorder's dumps "
        f"are in {folder}{analyzer}; {hint}"
    )


def _last(data: dict[str, Any], group: str | None = None) -> dict[str, Any] | None:
    """A dump's last collective (in `group`, by its name)."""
    entries = [e for e in data.get("entries") or [] if group is None or _group(e)[0] == group]
    return max(entries, key=lambda e: e.get("record_id", 0), default=None)


def _group(entry: dict[str, Any]) -> tuple[str, str]:
    """(name, description) of an entry's group: ("0", "default_pg"), ("2", "mesh_dp")."""
    name, desc = (list(entry.get("process_group") or ()) + ["", ""])[:2]
    return str(name), str(desc)


def _members(data: dict[str, Any], group: str) -> list[int]:
    ranks = ((data.get("pg_config") or {}).get(group) or {}).get("ranks", "[]")
    return [int(r) for r in re.findall(r"\d+", str(ranks))]


def _gather(cfg: Config, run_dir: Path, mine: dict[str, Any]) -> str:
    """Ask every rank for its dump (gloo; NCCL's watchdog has asked already) and wait for them a
    little: which ranks of the group never started the collective this rank waited in (their
    last one in the group is an earlier one), and which did not answer."""
    folder = RunDir(run_dir).flight_recorder
    if not uses_nccl(cfg):
        compat.default_store().set(_request_key(run_dir), "dump")
    last = _last(mine)
    if last is None:
        return "this rank had started no collective"
    group, seq = _group(last)[0], last.get("collective_seq_id", 0)
    paths = {r: folder / f"rank_{r}" for r in _members(mine, group) or range(dist.get_world_size())}
    deadline = time.monotonic() + min(GATHER_S, cfg.launch.collective_timeout)
    while time.monotonic() < deadline and not all(p.is_file() for p in paths.values()):
        time.sleep(0.2)
    seqs = {}
    for r, p in paths.items():
        try:
            theirs = _last(pickle.loads(p.read_bytes()), group)
        except Exception:  # noqa: BLE001 - none, half-written or unreadable: as if it had not come
            continue
        seqs[r] = theirs.get("collective_seq_id", 0) if theirs else 0
    behind = sorted(r for r, s in seqs.items() if s < seq)
    silent = sorted(set(paths) - set(seqs))
    parts = []
    if behind:
        last_ones = ", ".join(f"rank {r} #{seqs[r]}" for r in behind)
        parts.append(f"never started by rank(s) {', '.join(map(str, behind))} (their last: {last_ones})")
    if silent:
        parts.append(f"no dump from rank(s) {', '.join(map(str, silent))} (dead, or stuck holding the interpreter)")
    return "; ".join(parts) or "every rank of the group started it"


def _describe(data: dict[str, Any]) -> str:
    """`, in the last collective it started: gloo:all_gather #24 of group default_pg (ranks [0, 1]), sizes [[36]]`."""
    e = _last(data)
    if e is None:
        return ""
    name, desc = _group(e)
    ranks = ((data.get("pg_config") or {}).get(name) or {}).get("ranks", "?")
    return (
        f", in the last collective it started: {e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} "
        f"of group {desc or name} (ranks {ranks}), sizes {e.get('input_sizes')}"
    )


def dumps_since(run_dir: Path, since: float) -> list[Path]:
    """The flight-recorder dumps written since `since` (NCCL's watchdog's, on a timeout)."""
    folder = RunDir(run_dir).flight_recorder
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("rank_*") if not p.name.endswith(".tmp") and p.stat().st_mtime >= since)
