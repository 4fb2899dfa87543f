"""Under torchrun every rank runs the entry point (and so Hydra): its environment is checked
before anything reads it, and the ranks agree on one run directory through torchrun's own
store before Hydra composes, with only rank 0 writing `.hydra/` (each rank's own
timestamp would differ by the seconds its imports took)."""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, timedelta
from typing import Any

from composerun.errors import ConfigError

# Set when the ranks agreed on a timestamped run directory (no hydra.run.dir was given).
AGREED_RUN_DIR = "COMPOSERUN_AGREED_RUN_DIR"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and not os.environ.get("COMPOSERUN_SELF_LAUNCHED")


# Seconds a torchrun rank waits for torchrun's store: it is up before any rank starts, so a
# store that does not answer is a wrong address, not a slow start.
STORE_WAIT_S = 10


def check_environment(env: dict[str, str] | None = None) -> None:
    """The variables a launch reads, checked before anything reads them: ConfigError naming
    the variable.  Under torchrun (TORCHELASTIC_RUN_ID set), the rank variables it sets."""
    env = os.environ if env is None else env
    timeout = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if timeout is not None and not re.fullmatch(r"\s*\d+\s*", timeout):  # torch reads it with int()
        raise ConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={timeout!r}: must be a whole number of seconds (or unset: 30)"
        )
    if "TORCHELASTIC_RUN_ID" not in env or env.get("COMPOSERUN_SELF_LAUNCHED"):
        return
    why = "TORCHELASTIC_RUN_ID is set, so this process is taken for a rank torchrun started"
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        value = env.get(var)
        if value is None or not value.strip():
            raise ConfigError(f"{var} is not set ({why}): start it with torchrun, or unset TORCHELASTIC_RUN_ID")
        if var != "MASTER_ADDR" and not value.strip().isdigit():
            raise ConfigError(
                f"{var}={value!r} is not a number ({why}): start it with torchrun, or unset TORCHELASTIC_RUN_ID"
            )
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world < 1 or rank >= world:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world}: a rank is 0 to WORLD_SIZE-1 ({why})")


def torchrun_store() -> Any:
    """A client of the store torchrun's agent keeps for its ranks (TORCHELASTIC_USE_AGENT_STORE),
    or ConfigError within STORE_WAIT_S seconds naming the address that does not answer."""
    import socket

    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # A plain connection first: torch's client retries for half a minute past its timeout,
    # printing a C++ stack trace for each try.
    deadline, why = time.monotonic() + STORE_WAIT_S, ""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            break
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() > deadline:
            raise ConfigError(
                f"cannot reach torchrun's store at MASTER_ADDR:MASTER_PORT = {addr}:{port} within {STORE_WAIT_S} s "
                f"({why}): start the ranks with torchrun, or unset TORCHELASTIC_RUN_ID"
            )
        time.sleep(0.2)
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=120))


def torchrun_shim(argv: list[str]) -> list[str]:
    """Under torchrun: one run directory for all ranks, `.hydra/` from rank 0 only."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    extra = []
    given = any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv)
    # torchrun's agent keeps a store for its ranks: when it does not answer, the ranks would
    # wait for it for minutes (here, and in init_process_group)
    store = torchrun_store() if world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None
    if world > 1 and store is None and not given:  # each rank would take its own timestamped directory
        raise ConfigError(
            "torchrun without its agent store (TORCHELASTIC_USE_AGENT_STORE is not True): the ranks cannot agree "
            "on a run directory by themselves; give one with hydra.run.dir=DIR"
        )
    if not given and store is not None:
        # By default this is the store that torchrun's node-rank-0 agent created for this
        # launch, so the rendezvous id (`none` unless --rdzv-id is given on several nodes)
        # and the restart count tell runs apart; the ranks of every node read the same key.
        key = f"composerun/run_dir/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if rank == 0:
            store.set(key, datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S"))
        extra.append(f"hydra.run.dir={store.get(key).decode()}")
        os.environ[AGREED_RUN_DIR] = "1"  # (an elastic run restarted would agree on another: job.py refuses it)
    if rank > 0:
        extra += ["hydra.output_subdir=null", f"hydra.job.name=rank{rank}"]
    return argv + extra
