"""`api: compile` and the activation checkpointing that goes with it.

A compiled module is compiled where it stands: its `forward` is replaced by
`torch.compile(forward)` on the instance, so the module keeps its class, its place and its
parameters' names (no `_orig_mod.` wrapper), and the hooks of the APIs applied after it
(FSDP's all-gather and reduce-scatter, replicate's all-reduce) run outside the compiled
region, eagerly, around it (rules.py's order).  Identical blocks share one compiled graph
(torch's inlining of built-in modules: one compilation for every block of a model).

Activation checkpointing is `torch.utils.checkpoint` around the module's own forward, on
the instance: the hooks of the data-parallel APIs on the same module stay outside it (the
recomputation replays the forward alone, never FSDP's input cast or all-gather), and when
the module is compiled, or inside a compiled module, the compiler traces the checkpoint
(applied before compile: the checkpoint is inside the compiled region, and a selective
policy sees each op, which it cannot around an already compiled graph):

- `mode: full` recomputes every activation;
- `mode: selective` saves the outputs of `save_ops` (default: matrix products and attention,
  torchtitan's choice; communication outputs of tensor parallelism too) and recomputes the
  rest, through torch's selective-checkpoint contexts (eager or compiled); `save_mm_every: 2`
  keeps only every second matrix product (torchtitan's op-level policy);
- `mode: budget` leaves the choice to the compiler's partitioner under
  `memory_budget` (0: recompute what it can, 1: save everything): torch's
  `activation_memory_budget`, one value for the whole run (composerun/_torch_compat.py).

Under a torch dispatch mode (the memory tracker of the step `metrics.track_memory` measures)
torch.compile compiles nothing and the module runs eagerly, as it would without fullgraph.
A module that fails to compile fails at its first forward, inside a rank: the error names
the rule and the module, with the compiler's reason, and with `compile.fallback=eager` the
module runs eagerly instead (a warning).  Checks that need no compilation (mode, backend,
options) run before any rank starts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from composerun import _torch_compat as compat
from composerun.config.schema import RuleConfig
from composerun.errors import ConfigError

log = logging.getLogger("composerun")

# Selective checkpointing's default: keep what is costly to recompute (torchtitan's list).
DEFAULT_SAVE_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten._scaled_mm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    # float8's scales: the amax of each tensor, a scalar that is a whole pass over the tensor to
    # recompute and nothing to keep
    "aten.max",
)


def resolve_ops(where: str, names: list[str] | None) -> set[str]:
    """The ops a selective policy saves, by name (`aten.mm`; an overload such as
    `aten.mm.default` stands for the op), each checked to exist in torch."""
    out = set()
    for name in DEFAULT_SAVE_OPS if names is None else names:
        parts = str(name).split(".")
        packet = None
        if len(parts) >= 2:
            namespace = getattr(torch.ops, parts[0], None)
            packet = getattr(namespace, parts[1], None) if namespace is not None else None
        if packet is None or not isinstance(packet, torch._ops.OpOverloadPacket):
            if names is None:
                continue  # a default op this torch build lacks (cuDNN attention on a CPU build, say)
            raise ConfigError(f"{where}: {name!r} is no op torch knows; name ops as namespace.op, e.g. aten.mm")
        out.add(f"{parts[0]}.{parts[1]}")
    return out


def check_compile_options(where: str, rule: RuleConfig) -> None:
    """mode, backend and backend options that torch.compile knows (before any rank starts)."""
    import torch._dynamo
    import torch._inductor

    modes = list(torch._inductor.list_mode_options())
    if rule.mode is not None and rule.mode not in modes:
        raise ConfigError(f"{where}.mode={rule.mode}: torch.compile's modes are {', '.join(modes)}")
    if rule.mode is not None and rule.backend != "inductor":
        raise ConfigError(f"{where}.mode={rule.mode}: a mode of backend inductor, and the rule's backend is {rule.backend}")
    backends = torch._dynamo.list_backends(exclude_tags=())
    if rule.backend not in backends:
        raise ConfigError(f"{where}.backend={rule.backend}: torch.compile's backends here are {', '.join(backends)}")
    if rule.compile_options is not None and not isinstance(rule.compile_options, dict):
        raise ConfigError(f"{where}.compile_options={rule.compile_options!r}: a map of inductor options, e.g. {{max_autotune: true}}")
    if rule.compile_options:
        if rule.mode is not None:
            raise ConfigError(f"{where}: torch.compile takes mode or compile_options, not both; give one")
        if rule.backend == "inductor":
            known = set(torch._inductor.list_options())
            unknown = sorted(k for k in rule.compile_options if k not in known)
            if unknown:
                raise ConfigError(
                    f"{where}.compile_options.{unknown[0]}: not an option of inductor (torch._inductor.list_options())"
                )


def selective_context(save_ops: list[str], mm_every: int = 1) -> Callable[[], Any]:
    """torch's selective-checkpoint contexts for a policy that saves these ops' outputs and
    recomputes everything else; of the matrix products, only every `mm_every`-th of a
    forward (counted apart in the forward and in its recomputation, which meet the same ops)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(getattr(torch.ops, ns), op) for ns, op in (name.split(".") for name in save_ops)}
    matmuls = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten._scaled_mm} & saved

    def contexts() -> Any:
        seen = {False: 0, True: 0}  # matmuls met in the forward, and in the recomputation

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            packet = getattr(op, "overloadpacket", None)
            keep = packet in saved
            if keep and mm_every > 1 and packet in matmuls:
                seen[ctx.is_recompute] += 1
                keep = seen[ctx.is_recompute] % mm_every == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return contexts


def checkpoint_forward(module: nn.Module, ac: dict[str, Any]) -> None:
    """Activation checkpointing as torch.utils.checkpoint around the module's own forward,
    put on the instance (the module keeps its class and its parameters' names).  The hooks of
    the APIs applied to the same module (FSDP's input cast and all-gather, replicate's) run
    outside it, in the module's call: the recomputation in backward replays the forward alone,
    so a selective policy meets exactly the ops it saw (torch's composable `checkpoint` replays
    the whole call, FSDP's pre-forward hook included, and a bf16 input cast there is an op the
    policy never stored).  Compiled, the compiler traces the checkpoint with its policy."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if ac["mode"] == "selective":
        kwargs["context_fn"] = selective_context(ac["save_ops"], ac.get("save_mm_every", 1))

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kw: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kw)
        return checkpoint(forward, *args, **kwargs, **kw)

    checkpointed.composerun_checkpoint = ac["mode"]  # type: ignore[attr-defined]
    module.forward = checkpointed


def compile_module(module: nn.Module, options: dict[str, Any], label: str, fallback: bool) -> None:
    """Compile the module's forward in place (see the module's docstring)."""
    forward = module.forward
    kwargs: dict[str, Any] = {"fullgraph": options["fullgraph"], "dynamic": options["dynamic"]}
    kwargs["backend"] = options["backend"]
    if options.get("compile_options"):
        kwargs["options"] = dict(options["compile_options"])
    elif options["mode"] != "default":
        kwargs["mode"] = options["mode"]
    compat.compile_backward_eagerly()  # a backward that cannot compile fails in `call`, below
    compiled = torch.compile(forward, **kwargs)
    state = {"eager": False}

    @functools.wraps(forward)
    def call(*args: Any, **kw: Any) -> Any:
        # under a dispatch mode (the step metrics.track_memory measures) torch.compile runs no
        # frame compiled: eagerly, as it would itself, where fullgraph would make it raise
        if state["eager"] or compat.compile_runs_eagerly():
            return forward(*args, **kw)
        try:
            return compiled(*map(_unaliased, args), **kw)
        except Exception as e:  # noqa: BLE001 - any compiler failure: said once, in a line
            if not compat.is_compile_error(e):
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if not fallback:
                raise ConfigError(
                    f"{label}: torch.compile failed: {reason} (compile.fallback=eager runs it eagerly)"
                ) from e
            log.warning("%s: torch.compile failed, running eagerly (compile.fallback=eager): %s", label, reason)
            state["eager"] = True
            return forward(*args, **kw)

    call.composerun_compiled = options  # type: ignore[attr-defined]
    module.forward = call


def _unaliased(x: Any) -> Any:
    """A view that requires grad, copied: the compiled graph's gradient of a view input flows
    to the view's base, and where that base is a DTensor's local tensor (tensor parallelism's
    `to_local` output: the first block's input after the sharded embedding) the gradient
    skips DTensor's own backward (torch 2.13: an AttributeError, or with selective AC wrong
    gradients).  One activation copy, at the block that takes such an input."""
    if isinstance(x, torch.Tensor) and x.requires_grad and x._base is not None:
        return x.clone()
    return x


def is_compiled(module: nn.Module) -> bool:
    return hasattr(module.__dict__.get("forward"), "composerun_compiled")


def checkpointed(module: nn.Module) -> str | None:
    """The AC mode put around a module's forward (checkpoint_forward), or None."""
    fwd = module.__dict__.get("forward")
    while fwd is not None:
        mode = getattr(fwd, "composerun_checkpoint", None)
        if mode is not None:
            return mode
        fwd = getattr(fwd, "__wrapped__", None)
    return None


def set_memory_budget(budget: float | None) -> None:
    """The compiler's activation-memory budget for this process (mode: budget)."""
    compat.set_activation_memory_budget(1.0 if budget is None else budget)
