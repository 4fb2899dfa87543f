"""What `plan=true` prints of the pre-flight estimate (parallel/estimate.py), and the columns
a planned run's summary.json and the sweep report take from it."""

from __future__ import annotations

from typing import Any

from composerun.devices import GIB


def estimate_lines(report: dict[str, Any]) -> list[str]:
    """What `plan=true` prints of the estimate: the peak, whether it fits, the step time."""
    e = report.get("estimate")
    if not e:
        return []
    from composerun.parallel.plan import fmt_bytes

    peaks = e["peak_bytes_per_rank"]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(e["breakdown"].items(), key=lambda kv: -kv[1]) if v)
    lines = [f"estimated peak per rank: up to {fmt_bytes(peaks[worst])} (rank {worst}; rank {e['rank']} holds {parts})"]
    if e.get("batch_size") != e.get("configured_batch_size"):
        lines.append(f"(the step traced a global batch of {e['batch_size']}: data.batch_size does not split over this mesh)")
    if e.get("offload_counted_as_device_memory"):
        lines.append("(offloaded shards are counted as device memory: CPU offload is not modelled)")
    if "peak_reserved_bytes_per_rank" in e:
        lines[0] += f"; {fmt_bytes(max(e['peak_reserved_bytes_per_rank']))} reserved by the allocator"
    if "without_ac_peak_bytes_per_rank" in e:
        lines[0] += f"; without activation checkpointing {fmt_bytes(max(e['without_ac_peak_bytes_per_rank']))}"
    fits = fits_line(report)
    if fits:
        lines.append(fits)
    t = e.get("step_time")
    if t:
        fast, slow = t["step_s_range"]
        line = (
            f"estimated step on {t['device']}: {t['step_s']:.3g} s (range {fast:.3g}-{slow:.3g} s; compute {t['compute_s']:.3g} s: "
            f"matmuls {t['matmul_s']:.3g}, attention {t['attention_s']:.3g}, memory-bound {t['memory_bound_s']:.3g}, "
            f"optimizer {t['optimizer_s']:.3g}; collectives {t['comm_s']:.3g} s, {t['exposed_comm_s']:.3g} s of it exposed)"
        )
        if "tokens_per_s" in t:
            lo, hi = t["tokens_per_s_range"]
            line += f", {t['tokens_per_s']:,.0f} tokens/s ({lo:,.0f}-{hi:,.0f}), MFU {t['mfu']:.1%}"
        lines.append(line + " -- an estimate: plan.json's estimate.step_time.assumptions")
    return lines


def estimate_summary(report: dict[str, Any]) -> dict[str, Any]:
    """A planned run's summary.json keys of the estimate (the sweep report's columns)."""
    e = report.get("estimate")
    if not e:
        return {}
    out: dict[str, Any] = {"est_peak_bytes": max(e["peak_bytes_per_rank"])}
    if "peak_reserved_bytes_per_rank" in e:
        out["est_reserved_bytes"] = max(e["peak_reserved_bytes_per_rank"])
    m = e.get("memory", {})
    if "fits" in m:
        out.update(est_fits=m["fits"], est_largest_micro_batch=m.get("largest_micro_batch"))
    t = e.get("step_time")
    if t:
        out.update(est_step_s=t["step_s"], est_tokens_per_s=t.get("tokens_per_s"), est_mfu=t.get("mfu"))
    return out


def fits_line(report: dict[str, Any]) -> str | None:
    """The one line `plan=true` prints about memory: fits with X GiB to spare, or not."""
    m = report.get("estimate", {}).get("memory")
    if not m or m.get("limit_bytes") is None:
        return None
    with_reserve = ""
    if "reserve_bytes" in m:
        r = report["estimate"]["reserve"]
        with_reserve = (
            f" (with a reserve of {m['reserve_bytes'] / GIB:.1f} GiB: fragmentation {r['fragmentation'] / GIB:.1f}, "
            f"FSDP's stream pools {r['stream_pools'] / GIB:.1f}, CUDA context {r['cuda_context'] / GIB:.1f}, "
            f"NCCL {r['nccl_buffers'] / GIB:.1f})"
        )
    if m["fits"]:
        line = f"fits in {m['limit_bytes'] / GIB:.1f} GiB per rank with {m['spare_bytes'] / GIB:.2f} GiB to spare{with_reserve}"
    else:
        line = f"does not fit in {m['limit_bytes'] / GIB:.1f} GiB: needs {m['needed_bytes'] / GIB:.2f} GiB on rank {m['rank']}{with_reserve}"
    if m.get("largest_micro_batch") is not None:
        line += f"; the largest micro-batch that fits is {m['largest_micro_batch']} (data.batch_size={m['largest_batch_size']})"
    return line
