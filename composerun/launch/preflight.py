"""What a run is checked for before any rank starts, in the process that launches them.

A user's mistake must end the command with one line and exit code 2 before anything is
written, not inside a rank after a plan table was printed and a run directory half-filled.
So everything that can be known from the config and the files is checked here, against the
model built on the meta device (no memory, no initialisation):

- the device and backend exist here, and the mesh's ranks fit this machine;
- the policy applies (assign_units), the data source reads its files and takes its options, the
  model's forward takes the data's batches and the loss takes its output (on meta tensors),
  the optimizer takes its hyper-parameters;
- `checkpoint.init_from`: readable, with the model's keys and shapes; `model.pretrained`'s
  safetensors headers likewise (checkpoint/hf_import.py).

What a resume loads, and whether this command may write the run directory, is decided next,
once, under the run directory's lock (checkpoint/start.py), against the model's keys and
shapes found here.  The ranks check the files again as they read them: a file can change
between here and there.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from composerun.checkpoint.hf_export import check_export
from composerun.config.schema import Config, micro_batch_of
from composerun.data import build_data, check_seq_len, check_tokens, meta_batch
from composerun.data.sources import forward
from composerun.errors import CheckpointError, ConfigError, Unrunnable
from composerun.models.lora import frozen_names, is_adapter_key
from composerun.train.evaluate import check_eval

log = logging.getLogger("composerun")

# A CPU rank needs a share of a core and ~0.3 GiB; beyond this many per core, start-up alone
# takes minutes here (the suite's 2x4 runs are 4 per core on 2 cores).
RANKS_PER_CORE = 4
SEED_MAX = {"train.seed": 2**64, "data.seed": 2**44}  # data: seed * 1_000_003 + sample index fits in 64 bits


def check_run(cfg: Config, world: int, self_launched: bool) -> dict[str, tuple[int, ...] | None]:
    """Every check of the module's docstring; ConfigError with one line on the first failure
    (Unrunnable where the policy cannot run on the mesh or the model).  The model's state-dict
    keys and shapes (`model_shapes`), for the checks of a checkpoint to load."""
    from composerun.parallel.mesh import pick_device

    _check_seeds(cfg)
    check_export(cfg)  # checkpoint.export=hf: a model Hugging Face has a class for
    device, _ = pick_device(cfg.mesh)
    model = meta_model(cfg)
    if self_launched:
        check_machine_fits(cfg, world, device, model)
    check_policy(cfg, model, device)
    check_seq_len(cfg)  # (only where the run trains: train.steps > 0)
    data = build_data(cfg)
    check_tokens(cfg, data)  # every token id and the tokenizer within model.vocab_size
    check_eval(cfg, data)  # eval.every: a held-out split to evaluate, a batch the ranks can share
    _check_forward(cfg, model, data, world)
    _check_optimizer(cfg, model)
    want = model_shapes(model, frozen=True)  # (the base's tensors too, for the files that give them)
    if cfg.model.pretrained:  # (checkpoint/hf_import.py: the safetensors headers only)
        from composerun.checkpoint.hf_import import check_pretrained, check_sources
        from composerun.models.hf_layout import file_layout

        check_sources(cfg.checkpoint.init_from, cfg.model.pretrained)
        shapes = {k: v for k, v in want.items() if v is not None and not is_adapter_key(k)}
        check_pretrained(Path(cfg.model.pretrained), shapes, file_layout(model))  # (an expert's rows: its own tensors)
    if cfg.checkpoint.init_from:
        check_init_from(Path(cfg.checkpoint.init_from), want)
    return model_shapes(model)


def meta_model(cfg: Config) -> Any:
    """The configured model on the meta device: its structure, no memory, no initialisation."""
    import torch

    from composerun.models import build_model

    with torch.device("meta"):
        return build_model(cfg.model, cfg.adapter, cfg.train.seed)


# --- config values that need torch or a file ------------------------------------------------


def _check_seeds(cfg: Config) -> None:
    for key, top in SEED_MAX.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if not 0 <= value < top:
            raise ConfigError(f"{key}={value}: must be between 0 and {top - 1}")


def check_machine_fits(cfg: Config, world: int, device: str, model: Any = None) -> None:
    """The ranks this node starts fit its GPUs (one each) or, on CPU, its cores
    (RANKS_PER_CORE each, unless launch.oversubscribe=true); the model's parameters alone,
    spread evenly over every rank, fit this node's memory (a bound no policy can beat)."""
    import torch

    nodes = max(1, cfg.launch.nodes)
    local = world // nodes
    mesh = "x".join(map(str, cfg.mesh.shape))
    share = sum(p.numel() * p.element_size() for p in model.parameters()) / world if model is not None else 0
    if device == "cuda":
        need, have, where = share, torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    else:  # (the ranks of this node share its memory)
        need, have, where = share * local, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"
    if need > have:
        raise ConfigError(
            f"model {cfg.model.name or cfg.model._target_}: its parameters alone take {need / 2**30:,.1f} GiB even "
            f"fully sharded over mesh={mesh}, more than {where} {have / 2**30:,.1f} GiB: choose a smaller model "
            "(model.dim, ...) or more ranks (plan=true shows what a layout needs)"
        )
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if local > gpus:
            raise ConfigError(
                f"mesh={mesh} starts {local} ranks on this node, which has {gpus} GPUs (one rank per GPU): "
                "pick a smaller mesh, or spread it over nodes (launch.nodes)"
            )
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local > RANKS_PER_CORE * cores and not cfg.launch.oversubscribe:
        raise ConfigError(
            f"mesh={mesh} starts {local} ranks on this machine's {cores} CPU cores (at most {RANKS_PER_CORE} a "
            "core): pick a smaller mesh, plan it without ranks (plan=true), or add launch.oversubscribe=true"
        )


def check_policy(cfg: Config, model: Any, device: str | None = None) -> None:
    """The policy against the mesh, then matched against the model: Unrunnable (a sweep skips
    such a combination) naming the rule; float8 against the `device` to train on (none:
    plan=true, which plans float8 anywhere)."""

    from composerun.config.schema import mesh_dim_names
    from composerun.parallel import rule_checks, rules

    shape = list(cfg.mesh.shape)
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    try:
        rule_checks.check_policy(cfg.sharding, names, shape)
        rules.assign_units(model, rules.effective_rules(cfg.sharding), dict(zip(names, shape, strict=True)))
    except Unrunnable:
        raise
    except ConfigError as e:
        raise Unrunnable(str(e)) from None
    if device is not None and any(r.api.value == "float8" for r in cfg.sharding.rules):
        from composerun.parallel.float8 import check_float8_here

        check_float8_here(device)


# What a forward on meta tensors reports as the user's mistake: a shape or dtype that does not
# fit.  Anything else (a model that needs real values, a process group, an op with no meta
# kernel) says nothing about the config, and is left for the ranks to meet.
_MISFIT = re.compile(
    r"shape|size of tensor|sizes? mismatch|must match|dimension|Dimension out of range|mat1 and mat2|"
    r"reduction dim|same dtype|expected scalar type|indices|of \w+ and \w+ tensors|looked up with"
)
_CANNOT_TELL = re.compile(r"meta|data-dependent|item\(\)|NotImplemented|process group")


def _dtype_checks() -> Any:
    """A dispatch mode that makes the checks meta kernels skip and real ones make: a matrix
    product of two dtypes (token ids into a Linear), an embedding looked up by floats."""
    import torch

    from composerun._torch_compat import TorchDispatchMode

    aten = torch.ops.aten
    products = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.mv, aten.addmv, aten.dot)

    class DtypeChecks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket
            if op in products:
                dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)})
                if len(dtypes) > 1:
                    raise RuntimeError(f"{op.__name__} of {' and '.join(dtypes)} tensors")
            elif op is aten.embedding and len(args) > 1 and args[1].is_floating_point():
                raise RuntimeError(f"embedding looked up with {str(args[1].dtype).removeprefix('torch.')} indices")
            return func(*args, **(kwargs or {}))

    return DtypeChecks()


def _check_forward(cfg: Config, model: Any, data: Any, world: int) -> None:
    """One micro-batch of the data through the model and the loss, on meta tensors."""

    micro = micro_batch_of(cfg)
    x, y = meta_batch(data, micro)  # (shapes and dtypes: no memory of model.dim's size)
    try:
        with _dtype_checks():  # (with gradients: a forward may take its own, torch.autograd.grad)
            data.loss(forward(model, x.to("meta")), y.to("meta"))
    except Exception as e:  # noqa: BLE001 - a misfit of shapes or dtypes is reported, the rest let through
        text = f"{type(e).__name__}: {e}"
        if isinstance(e, NotImplementedError) or _CANNOT_TELL.search(text) or not _MISFIT.search(text):
            return
        raise ConfigError(
            f"model {cfg.model.name or cfg.model._target_} cannot take the batches of "
            f"data._target_={cfg.data._target_}: {text.splitlines()[0]}; check model.task (now {cfg.model.task.value}), "
            "model.in_dim/out_dim and model.vocab_size"
        ) from None


_OPTIM_KEYS = {
    "learning rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "beta": "optim.kwargs.betas",
    "epsilon": "optim.kwargs.eps",
    "momentum": "optim.kwargs.momentum",
}


def _check_optimizer(cfg: Config, model: Any) -> None:
    """The optimizer class takes its hyper-parameters and the model's kinds of parameters."""
    import torch

    from composerun.train.optim import build_optimizer

    # stand-ins of the model's parameters: the same count, dtypes and number of dims, one element each
    stand_in = torch.nn.ParameterList(
        torch.nn.Parameter(torch.zeros((1,) * p.dim(), dtype=p.dtype), requires_grad=p.requires_grad)
        for p in model.parameters()
    )
    try:
        build_optimizer(stand_in, cfg.optim)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        key = next((k for s, k in _OPTIM_KEYS.items() if s in text), "optim")
        raise ConfigError(f"{key}: {text} (optim._target_={cfg.optim._target_})") from None


# --- files: init_from -----------------------------------------------------


def model_shapes(model: Any, frozen: bool = False) -> dict[str, tuple[int, ...] | None]:
    """The model's state-dict keys, as a checkpoint stores them (without the frozen parameters
    of an adapter run: checkpoint/adapters.py; `frozen`: with them), and each tensor's shape."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    left_out = set() if frozen else frozen_names(model)
    sd = get_model_state_dict(model)
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in sd.items() if k not in left_out}


def check_init_from(path: Path, want: dict[str, tuple[int, ...] | None]) -> None:
    from composerun.checkpoint.export import check_fits, read_shapes

    try:
        have = read_shapes(path)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    base = {k: v for k, v in want.items() if v is not None and not is_adapter_key(k)}  # (adapters: models/lora.py)
    check_fits(f"checkpoint.init_from={path}", have, base)
