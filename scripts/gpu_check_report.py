"""What scripts/gpu_check.py writes for a reader: the markdown tables of gpu_check.md (the runs
with their estimates beside them, then the checks), the end of each item's output
(gpu_check.log), and the pytest results read from its JUnit XML."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

GIB = 2**30
TAIL_LINES = 60  # of each item's output, in gpu_check.log


def junit_cases(xml: Path) -> list[dict[str, Any]]:
    """pytest's --junitxml: every test with its outcome, time and first message line."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        out.append({
            "name": f"{case.get('classname', '')}::{case.get('name', '')}",
            "outcome": outcome,
            "seconds": round(float(case.get("time") or 0.0), 1),
            "message": message,
        })  # fmt: skip
    return out


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def gib(x: Any) -> str:
    """Bytes as GiB (MiB under one GiB: a dry run's tiny model)."""
    if not _num(x):
        return "—"
    return f"{x / GIB:.1f} GiB" if x >= GIB else f"{x / 2**20:.1f} MiB"


def pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if _num(x) else "—"


def rate(x: Any) -> str:
    return f"{x:,.0f}" if _num(x) else "—"


def secs(x: Any) -> str:
    return f"{x:.0f} s" if _num(x) else "—"


def ms(x: Any) -> str:
    return f"{1e3 * x:.0f} ms" if _num(x) else "—"


def _cell(text: Any) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def _status(item: dict[str, Any]) -> str:
    return item["status"] if item["status"] == "ok" else f"{item['status']}: {_cell(item.get('reason'))}"


def _env_line(data: dict[str, Any]) -> str:
    env, shape = data.get("environment") or {}, data["shape"]
    gpu = env.get("gpu") or "no GPU (CPU)"
    if env.get("capability"):
        gpu += f" (compute capability {'.'.join(map(str, env['capability']))}, {gib(env.get('memory_bytes'))})"
    commit = env.get("commit") or "unknown commit"
    if env.get("tree_changed"):
        commit += " + uncommitted changes"
    return (
        f"{gpu}; torch {env.get('torch', '?')} (CUDA {env.get('cuda') or '—'}), Python {env.get('python', '?')}; "
        f"composerun {commit}.  Shape: {shape['model']}, global batch {shape['batch']} on one rank, "
        f"{shape['steps']} steps, the device read every {shape['log_every']} steps, {shape['param_dtype']} parameters "
        f"(fp32 master weights and gradient reduction, AdamW), synthetic tokens.  Whole check: "
        f"{data['wall_s']:.0f} s of a {data['budget_s']:.0f} s budget"
        + ("." if data.get("finished", True) else ", still running (or cut short).")
    )


RUN_HEADER = (
    "| run | status | step (median) | tokens/s | MFU | max allocated | max reserved | tracker peak "
    "| est. peak | est. reserved | est. tokens/s | est. MFU | first step |\n|" + "---|" * 13
)


def _run_row(item: dict[str, Any]) -> str:
    est = item.get("estimate") or {}
    ok = est.get("status", "ok") == "ok"
    cells = [
        item["name"], _status(item), ms(item.get("step_s")), rate(item.get("tokens_per_s")), pct(item.get("mfu")),
        gib(item.get("max_memory_allocated_bytes")), gib(item.get("max_memory_reserved_bytes")),
        gib(item.get("tracker_peak_bytes")),
        gib(est.get("peak_bytes")) if ok else f"{est['status']}: {_cell(est.get('reason'))}",
        gib(est.get("reserved_bytes")), rate(est.get("tokens_per_s")), pct(est.get("mfu")), secs(item.get("time_to_first_step_s")),
    ]  # fmt: skip
    return "| " + " | ".join(_cell(c) if i != 1 else c for i, c in enumerate(cells)) + " |"


def _check_detail(item: dict[str, Any]) -> str:
    if item["name"] == "install":
        return f"{len(item.get('wheels') or [])} carried wheels, then composerun from the tree (--no-deps)" + (
            f"; {item['note']}" if item.get("note") else ""
        )
    if item["name"] == "environment":
        v = item.get("versions") or {}
        return ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k]) or "—"
    if item.get("counts"):
        c = item["counts"]
        failed = [x["name"] for x in item.get("cases", []) if x["outcome"] == "failed"]
        return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped" + (
            f" ({', '.join(failed)})" if failed else ""
        )
    return item.get("test") or item.get("detail") or ""


def markdown(data: dict[str, Any]) -> str:
    dry = " — dry run on the CPU (plumbing only: no figure here is a GPU's; est.: an H100's)"
    title = "GPU check" + (dry if data["dry_run"] else "")
    lines = [f"### {title}", "", _env_line(data), "", RUN_HEADER]
    runs = [i for i in data["items"] if i["kind"] in ("run", "torchtitan")]
    lines += [_run_row(i) for i in runs]
    lines += [
        "",
        "Step, tokens/s and MFU: the median over the logged intervals after the first "
        f"{data['shape']['log_every']} steps (composerun's own rates; MFU against the datasheet's dense bf16 peak).  "
        "Max allocated / reserved: torch.cuda's peaks over the run; tracker peak: the memory tracker's one "
        "step (eager only); est.: `plan=true` on the same command for this GPU.",
        "",
        "| check | status | time | detail |",
        "|---|---|---|---|",
    ]
    for item in data["items"]:
        if item["kind"] in ("install", "tests", "check"):
            lines.append(
                f"| {item['name']} | {_status(item)} | {secs(item.get('seconds'))} | {_cell(_check_detail(item))} |"
            )
    return "\n".join(lines) + "\n"


def log_tails(items: list[dict[str, Any]]) -> str:
    """The command and the last lines of every item's output, the estimates' too."""
    out = []
    for item in items:
        for name, what in ((item["name"], item), (f"{item['name']} (estimate)", item.get("estimate") or {})):
            log = what.get("log")
            if not log or not Path(log).is_file():
                continue
            text = Path(log).read_text(errors="replace").splitlines()
            # the command (the log's first line), then the end of the output
            shown = text if len(text) <= TAIL_LINES + 1 else [text[0], "...", *text[-TAIL_LINES:]]
            out += [f"===== {name}: {what.get('status')} ({what.get('seconds')} s)", *shown, ""]
    return "\n".join(out) + "\n"
