"""The pre-flight estimate (`plan=true`): peak memory per rank, whether it fits, the largest
micro-batch that does, and the step time on a named device, before a job queues.

One training step of the configured model, policy and micro-batch is run on fake tensors
(torch's FakeTensorMode: shapes and dtypes, no memory, no arithmetic) on the fake process
group, as the planner's rank plays it: the model built on the meta device with the policy
applied (tensor parallelism, activation checkpointing, FSDP: all but compile, which changes
the kernels, not what is held), made fake, and every micro-batch's forward and backward run
under torch's own memory tracker (`FSDPMemTracker`, or `MemTracker` where the root is no
FSDP unit), which attributes each tensor alive at the peak to parameters, gradients,
activations, temporaries, FSDP's all-gather and reduce-scatter buffers.  The optimizer's
state is the plan's (its tensors exist from the first step on, all through the next step's
forward and backward); the optimizer step itself holds parameters, gradients and state.

- On a CPU mesh (gloo, no plan.device) the estimate also holds what gloo's reduce-scatter
  copies (its whole input, beside it, after each unit's backward: seen in the tracker).
- Peak per rank: the step is run as one rank (the plan's first); another rank's peak is
  that peak moved by the difference of what the two hold (parameters, gradients, optimizer
  state: plan.json's bytes_per_rank), activations being the same on every rank.
- Fits: the peak against `plan.memory_gib` or the device's memory; the largest micro-batch
  that fits is found by running the step at other sizes (a line through two peaks, checked
  and narrowed).
- Step time on `plan.device`: torch's roofline of each op (runtime_estimator's model: an op
  takes max(its FLOPs / 75 % of the device's peak, its bytes read and written / the memory
  bandwidth)) over the traced step, the optimizer step as bandwidth (7 fp32 reads and writes
  per parameter), and the collectives (plan.json's comm_per_step) priced by the mesh dims
  they span (parallel/topology.py: rings at NVLink inside a node, through the NICs across
  nodes of `plan.gpus_per_node`, with NCCL's bus-bandwidth efficiency and latency).
  Reported both without overlap of compute and communication (the estimate) and with full
  overlap (a lower bound); tokens/s and MFU from the first.

Not modelled (docs/planning.md): the caching allocator's fragmentation and rounding, CUDA and NCCL's
own workspaces, compile's fused kernels (the eager step is estimated), mode budget's
recomputation (estimated as no activation checkpointing), the temporaries of an optimizer
that is not fused (AdamW's foreach implementation: about a parameter shard more), CPU
offload (counted as device memory), kernels' real efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from composerun import _torch_compat as compat
from composerun.config.schema import Config, ShardingConfig, dp_size_of, micro_batch_of
from composerun.data.sources import Packed, forward
from composerun.devices import GIB, plan_device
from composerun.errors import ConfigError, Unrunnable
from composerun.parallel.op_costs import OpCosts
from composerun.parallel.reserve import allocated_limit, needed, reserve, reserved
from composerun.parallel.step_time import step_time

# The tracker's categories (FSDPMemTracker's and MemTracker's names) as plan.json names them.
CATEGORIES = {
    "sharded param": "params",
    "parameter": "params",
    "unsharded param": "unsharded_params",
    "buffer": "buffers",
    "sharded grad": "grads",
    "gradient": "grads",
    "unsharded grad": "unsharded_grads",
    "activation": "activations",
    "temp": "temporaries",
    "all gather": "all_gather_buffers",
    "reduce scatter": "reduce_scatter_buffers",
    "inputs": "inputs",
    "other": "other",
    "optstate": "optimizer",
}
def categorized(snapshot: dict[Any, int]) -> dict[str, int]:
    """A tracker's snapshot {category: bytes, "Total": bytes} as plan.json names the categories
    (CATEGORIES), without the total and the empty ones."""
    out: dict[str, int] = {}
    for key, value in snapshot.items():
        name = str(getattr(key, "value", key)).lower()
        if name != "total" and value:
            label = CATEGORIES.get(name, name.replace(" ", "_"))
            out[label] = out.get(label, 0) + int(value)
    return out


MAX_MICRO = 1 << 16  # the micro-batch search stops here (a fit that large says nothing more)


@dataclass
class StepMemory:
    peak: int  # bytes at the peak of the forward and backward passes, without optimizer state
    breakdown: dict[str, int]


def estimate_policy(sharding: ShardingConfig) -> ShardingConfig:
    """The policy as the estimate applies it: without compile (it changes kernels, not what
    is held), mode budget's checkpointing (the compiler's choice: estimated as none) and float8
    (its products need a GPU; estimated in the parameters' dtype)."""
    def kept(r: Any) -> bool:
        return r.api.value not in ("compile", "float8") and not (r.api.value == "checkpoint" and r.mode == "budget")

    return replace(sharding, rules=[r for r in sharding.rules if kept(r)])


def without_ac(sharding: ShardingConfig) -> ShardingConfig:
    return replace(sharding, rules=[r for r in sharding.rules if r.api.value != "checkpoint"])


def _on_gloo(cfg: Config) -> bool:
    """Whether the planned run's collectives are gloo's (a CPU mesh, planned for no device)."""
    from composerun.parallel.mesh import pick_device

    if cfg.plan.device is not None:
        return False
    try:
        return pick_device(cfg.mesh)[1] == "gloo"
    except ConfigError:  # (mesh.device=cuda planned on a machine without one)
        return False


def _batch(cfg: Config, micro: int) -> tuple[Any, torch.Tensor]:
    """A micro-batch as composerun's data sources make it: token ids and their next tokens
    (with each token's position in its document where data=sft packs rows: the model then
    builds its block-causal mask, whose memory and attention kernel the estimate counts), or
    features and targets (in_dim, out_dim)."""
    if cfg.model.task.value == "tokens":
        seq = cfg.data.seq_len or cfg.model.seq_len
        ids = torch.zeros(micro, seq, dtype=torch.long)
        if str(cfg.data._target_).endswith("SFTData") and getattr(cfg.data, "packing", False):
            ids = Packed(ids, torch.arange(seq).expand(micro, seq).contiguous())
        return ids, torch.zeros(micro, seq, dtype=torch.long)
    m = cfg.model
    return torch.zeros(micro, m.in_dim or m.dim or 1), torch.zeros(micro, m.out_dim or m.dim or 1)


def _loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The data sources' own losses (data/sources.py, data/tokens.py)."""
    if task == "tokens":
        return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    return F.mse_loss(out, y)


class FakeStep:
    """A model (built on meta, its policy applied on the fake process group) made of fake
    tensors, and its training step run on them at any micro-batch size."""

    def __init__(self, cfg: Config, model: nn.Module, loss_parallel: bool, fake: Any = None) -> None:
        """`model` on the meta device (made fake here), or built in `fake`, a fake tensor mode."""
        from composerun.parallel.apply import MicroBatchSwitches

        self.cfg, self.model, self.loss_parallel = cfg, model, loss_parallel
        self.switches = MicroBatchSwitches(model, cfg.sharding, cfg.train.grad_accum)
        self.gloo = _on_gloo(cfg)
        self.fake = fake or compat.fake_tensor_mode()
        if fake is None:
            with self.fake:
                model.to_empty(device="cpu")

    def run(self, micro: int, *modes: Any) -> StepMemory:
        """Every micro-batch's forward and backward at this size under the memory tracker
        (and `modes`, other dispatch modes: the roofline); the peak and what it holds."""
        from composerun.parallel.apply import loss_context

        for p in self.model.parameters():
            p.grad = None
        tracker = compat.memory_tracker(self.model)
        try:
            with self.fake:
                x, y = _batch(self.cfg, micro)
                accum, task = self.cfg.train.grad_accum, self.cfg.model.task.value
                with tracker, loss_context(self.loss_parallel):
                    for m in modes:
                        m.__enter__()
                    after: list[dict[str, int]] = []  # every unit's state after its post-backward
                    try:
                        for i in range(accum):
                            if i:  # (the tracker takes one forward per unit: statistics kept, cleared)
                                after += compat.post_backward_snapshots(tracker)
                                compat.next_iteration(tracker)
                            self.switches.set(i == accum - 1)
                            _loss(task, forward(self.model, x), y).backward()
                        after += compat.post_backward_snapshots(tracker)
                    finally:
                        for m in reversed(modes):
                            m.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001 - a forward fake tensors cannot run is the user's to know
            op = compat.fake_tensor_failure(e)
            if op is None:
                raise
            m = self.cfg.model
            name = f"{m.name} ({m._target_})" if m.name else m._target_
            raise ConfigError(
                f"model {name}: its forward cannot run on fake tensors "
                f"(plan=true's estimate): {op} needs real values; plan.estimate=false plans it without the estimate"
            ) from None
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
        if self.gloo:  # gloo's reduce-scatter copies its input (on the calling thread, so tracked)
            for state in after:
                rs = state.get("Reduce Scatter", 0)
                if state["Total"] + rs > snap.get("Total", 0):
                    snap = {**state, "Temp": state.get("Temp", 0) + rs, "Total": state["Total"] + rs}
        breakdown = categorized(snap)
        return StepMemory(int(snap.get("Total", sum(breakdown.values()))), breakdown)


def estimate(cfg: Config, step: FakeStep, report: dict[str, Any], rank: int, no_ac: FakeStep | None) -> dict[str, Any]:
    """plan.json's `estimate` (the module's docstring): `step` made for rank `rank` of the
    plan `report`; `no_ac`: the same without activation checkpointing, where the policy has it."""
    pcfg = cfg.plan
    device = plan_device(pcfg.device) if pcfg.device is not None else None
    micro = micro_batch_of(cfg)
    costs = OpCosts(device) if device is not None else None
    handles = costs.watch(step.model, *_compiled_and_float8(report)) if costs else []
    try:
        mem = step.run(micro, *([costs] if costs else []))
    finally:
        for h in handles:
            h.remove()
    held = dict(report["bytes_per_rank"])
    held["optim"] = [b + _step_counters(cfg, step.model) for b in held["optim"]]
    static = [held["params"][r] + held["grads"][r] + held["optim"][r] for r in range(len(held["params"]))]

    def peaks(m: StepMemory) -> list[int]:
        """Every rank's peak: the step's (with its optimizer state) moved by what each holds."""
        mine = max(m.peak + held["optim"][rank], static[rank])
        return [mine - static[rank] + s for s in static]

    per_rank = peaks(mem)
    dp = dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
    out: dict[str, Any] = {
        "rank": rank,
        "micro_batch": micro,
        "grad_accum": cfg.train.grad_accum,
        # the global batch the step traced (data.batch_size, unless it does not split over the
        # planned mesh: then a micro-batch of at least 1 on every data-parallel replica)
        "batch_size": micro * dp * cfg.train.grad_accum,
        "configured_batch_size": cfg.data.batch_size,
        "peak_bytes_per_rank": per_rank,
        "breakdown": {**mem.breakdown, "optimizer": held["optim"][rank]},
    }
    if any(r.offload for r in cfg.sharding.rules):
        out["offload_counted_as_device_memory"] = True  # (not modelled: the fake step has one device)
    if no_ac is not None:
        out["without_ac_peak_bytes_per_rank"] = peaks(no_ac.run(micro))
    limit = pcfg.memory_gib * GIB if pcfg.memory_gib else (device.memory_gib * GIB if device else None)
    fixed = None
    if not step.gloo:  # a GPU's rank: the allocator's and CUDA's share beyond the tensors (parallel/reserve.py)
        fixed = reserve(report, list(cfg.mesh.shape))
        worst = max(per_rank)
        out["reserve"] = {**fixed, "fragmentation": int(worst * fixed["fragmentation_share"])}
        out["peak_reserved_bytes_per_rank"] = [reserved(p, fixed) for p in per_rank]
    out["memory"] = _fit(cfg, step, per_rank, limit, micro, peaks, fixed)
    if device is not None and costs is not None:
        out["step_time"] = step_time(cfg, device, costs, report, step.model, micro_batch_of(cfg))
    return out


def _compiled_and_float8(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The FQNs of the modules the run compiles, and of the linears it runs in float8 (the
    fake step runs them eagerly, in the parameters' dtype: the step time prices them)."""
    compiled, float8 = [], []
    for u in report["units"]:
        fqn = "" if u["fqn"] == "<root>" else u["fqn"]
        if "compile" in u["apis"]:
            compiled.append(fqn)
        for sub in u.get("api_options", {}).get("float8", {}).get("converted", []):
            float8.append(f"{fqn}.{sub}" if fqn else sub)
    return compiled, float8


def _step_counters(cfg: Config, model: nn.Module) -> int:
    """The optimizer's 0-dim step counter per parameter (plan.json's optimizer bytes leave them
    out): torch's Adam family, Adagrad and RMSprop keep one float32 each; SGD none."""
    name = cfg.optim._target_.rsplit(".", 1)[-1]
    return 0 if name == "SGD" else 4 * sum(1 for p in model.parameters() if p.requires_grad)


def _fit(
    cfg: Config, step: FakeStep, per_rank: list[int], limit: float | None, micro: int, peaks: Any, fixed: dict[str, Any] | None
) -> dict[str, Any]:
    """Fits or not, by how much, and the largest micro-batch that fits (with the reserve
    `fixed` on a GPU: the allocated peak must stay under the limit less the reserve)."""
    worst = max(range(len(per_rank)), key=per_rank.__getitem__)
    need = needed(per_rank[worst], fixed) if fixed else per_rank[worst]
    out: dict[str, Any] = {"limit_bytes": int(limit) if limit else None, "rank": worst, "needed_bytes": need}
    if limit is None:
        return out
    out["fits"] = need <= limit
    out["spare_bytes"] = int(limit - need)
    if fixed:
        out["reserve_bytes"] = need - per_rank[worst]
        limit = allocated_limit(limit, fixed)  # (the search compares allocated peaks)
    if not cfg.plan.search_batch:
        return out
    known: dict[int, int] = {micro: per_rank[worst]}

    def peak(m: int) -> int:
        if m not in known:
            known[m] = max(peaks(step.run(m)))
        return known[m]

    if peak(1) > limit:  # (a sweep skips such a layout: Unrunnable)
        one = needed(peak(1), fixed) if fixed else peak(1)
        raise Unrunnable(
            f"does not fit even with a micro-batch of 1: rank {worst} needs {one / GIB:.2f} GiB of the "
            f"{out['limit_bytes'] / GIB:.1f} GiB per rank (plan.memory_gib or plan.device): use more ranks, a policy that "
            "shards or checkpoints more, or a shorter data.seq_len"
        )
    lo, hi = _largest_fit(peak, limit, micro)
    while hi - lo > 1:  # (memory grows with the micro-batch: the last that fits, between the two)
        mid = _guess(known, limit, lo, hi)
        lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
    dp = dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
    out["largest_micro_batch"] = lo
    out["largest_batch_size"] = lo * dp * cfg.train.grad_accum
    return out


def _largest_fit(peak: Any, limit: float, micro: int) -> tuple[int, int]:
    """A micro-batch that fits and a larger one that does not (or MAX_MICRO + 1), found from a
    straight line through the peaks of two sizes (activations grow with the micro-batch),
    checked, and widened while the line's guess is wrong."""
    probes = sorted({1, micro, 2 * micro})
    failing = [m for m in probes if peak(m) > limit]
    hi = failing[0] if failing else None
    lo = max(m for m in probes if peak(m) <= limit and (hi is None or m < hi))  # (1 fits: checked before)
    known = {m: peak(m) for m in (1, 2 * micro)}
    while hi is None:
        guess = min(MAX_MICRO + 1, max(2 * lo, _guess(known, limit, lo, MAX_MICRO + 2) + 1))
        if guess > MAX_MICRO:
            return lo, MAX_MICRO + 1
        if peak(guess) <= limit:
            lo, known[guess] = guess, peak(guess)
        else:
            hi = guess
    return lo, hi


def _guess(known: dict[int, int], limit: float, lo: int, hi: int) -> int:
    """Where the line through the two known peaks nearest the limit crosses it, strictly
    between lo and hi."""
    (m1, p1), (m2, p2) = sorted(known.items(), key=lambda kv: abs(kv[1] - limit))[:2]
    slope = (p2 - p1) / (m2 - m1) if m2 != m1 else 0
    guess = m1 + (limit - p1) / slope if slope > 0 else (lo + hi) / 2
    return int(min(hi - 1, max(lo + 1, guess)))
