"""The command's own clock, for its "done" line: the time a user waited, from the command's
start to its end, and, where the start-up is a large part of it, what the start-up went to.

The ranks know only their own time (summary.json's wall_s, from their set-up to their
summary); the imports, Hydra's composition, the pre-flight checks and starting the ranks come
before it.  The command's start is its process's (under torchrun, the agent's: the ranks'
parent), read from /proc where there is one, else the moment this module was imported.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_IMPORTED = time.time()

# the breakdown is shown when the time before the ranks' first step is at least this share
STARTUP_SHOWN = 0.25


def process_started(pid: int | None = None) -> float:
    """Unix time process `pid` (this one by default) started."""
    try:
        fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in clock ticks
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return _IMPORTED


# the longest an interpreter takes from its start to importing composerun (~0.1 s on an idle machine)
EXEC_SLACK_S = 2.0


def command_started(under_torchrun: bool) -> float:
    """When the command started: its process's start (under torchrun, the agent's).  A process
    starts on Linux when it is forked, so one that ran something else before it exec'd Python
    (the last command of `bash -c "pip install . && composerun ..."`, a script's `exec`) started
    long before the command; the command then starts when Python imported composerun."""
    if under_torchrun:
        return process_started(os.getppid())
    import composerun

    forked = process_started()
    return forked if forked >= composerun.IMPORTED - EXEC_SLACK_S else composerun.IMPORTED


def done_line(summary: dict[str, Any], started: float, checked: float, launched: float, ranks: int) -> str:
    """The command's last line: `summary` is rank 0's; `started`, `checked`, `launched`: when
    the command started, when its checks began (imports and Hydra done), when it started the
    ranks (checks done), as Unix times."""
    now = time.time()
    loss = summary.get("final_loss")
    loss_text = f"{loss:.4g}" if isinstance(loss, float) else "n/a"
    if summary.get("last_val_loss") is not None:
        loss_text += f" (validation {summary['last_val_loss']:.4g})"
    med = summary.get("median_step_s")
    step_text = f"{med * 1e3:.1f} ms/step" if isinstance(med, float) else "no steps run"
    head = (
        f"composerun: done: {summary.get('model')} on mesh {summary.get('mesh')} ({summary.get('policy')}), "
        f"{summary.get('steps')} steps, final loss {loss_text}, {step_text}, {now - started:.1f} s"
    )
    parts = _startup(summary, started, checked, launched, now, ranks)
    return f"{head}{f' ({parts})' if parts else ''}; run dir {summary.get('run_dir')}"


def _startup(summary: dict[str, Any], started: float, checked: float, launched: float, now: float, ranks: int) -> str:
    """What the time before the first step went to, when that is a large share of the whole."""
    first_end, to_first = summary.get("first_step_end_unix"), summary.get("time_to_first_step_s")
    if not isinstance(first_end, float) or not isinstance(to_first, float):
        return ""
    set_up = first_end - to_first  # when the ranks' run began (torch imported, the group joined)
    if (first_end - started) < STARTUP_SHOWN * (now - started):
        return ""
    noun = "rank" if ranks == 1 else "ranks"
    shares = [
        ("imports and config", checked - started),
        ("checks", launched - checked),
        (f"starting {ranks} {noun}", set_up - launched),
        ("set-up and first step", to_first),
        ("training and saving", now - first_end),
    ]
    return ", ".join(f"{name} {max(seconds, 0.0):.1f} s" for name, seconds in shares)
