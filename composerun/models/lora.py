"""LoRA adapters (`adapter=lora`): a low-rank update beside each target linear, the base weights frozen.

Each target `nn.Linear` (`adapter.targets`, FQN globs as in sharding rules) keeps its own module,
class and parameters, so the base's state-dict keys are what they are without an adapter (a
pretrained directory, a checkpoint or an export of the base reads the same names).  Beside its
weight it gets two child linears, `lora_A` (rank x in, no bias) and `lora_B` (out x rank, no
bias), a `lora_dropout`, and a forward hook adding `lora_B(lora_A(dropout(x))) * alpha / rank`
to its output: PEFT's names (`<fqn>.lora_A.weight`), so its export is a rename of the prefix.

A starts as PEFT starts it (kaiming-uniform with a = sqrt(5): uniform within 1/sqrt(in)), B at
zero, so the first forward is the base model's.  A is drawn from a generator of its own, seeded
by `adapter_seed(train.seed, fqn)`: the same on every mesh, whichever other tensors the model
initializes (or reads from files) first, and reproducible outside composerun.  The adapters are
float32 parameters (a policy's param_dtype casts them for the compute only, as it does the base).

Every parameter that is neither an adapter's nor matched by `adapter.train` has
requires_grad=False before any sharding API sees the model: no gradient, no optimizer state
(train/optim.py), and fully_shard shards frozen and trained parameters of a unit together.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from composerun.config.schema import Adapter, AdapterConfig
from composerun.errors import ConfigError
from composerun.parallel.globs import glob_to_regex

ADAPTER_PARTS = ("lora_A", "lora_B")


def adapter_seed(seed: int, fqn: str) -> int:
    """The seed of the generator that draws the A of the linear `fqn` in a run seeded `seed`: the
    CRC-32 of `SEED/FQN` (a CPU generator keeps 32 bits of its seed: all of them must differ)."""
    return zlib.crc32(f"{seed}/{fqn}".encode())


class LoraDown(nn.Linear):
    """A: in -> rank, kaiming-uniform (a = sqrt(5)) from its own generator."""

    def __init__(self, d_in: int, rank: int, seed: int, device: Any) -> None:
        self.seed = seed  # (before nn.Linear's constructor, which calls reset_parameters)
        super().__init__(d_in, rank, bias=False, device=device, dtype=torch.float32)

    def full_weight(self) -> torch.Tensor:
        """The whole initial A, on the CPU."""
        full = torch.empty(self.weight.shape, dtype=torch.float32)
        return nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=torch.Generator().manual_seed(self.seed))

    def reset_parameters(self) -> None:
        _fill(self.weight, self.full_weight())


class LoraUp(nn.Linear):
    """B: rank -> out, zeros (the adapter adds nothing until it has trained)."""

    def __init__(self, rank: int, d_out: int, device: Any) -> None:
        super().__init__(rank, d_out, bias=False, device=device, dtype=torch.float32)

    def full_weight(self) -> torch.Tensor:
        return torch.zeros(self.weight.shape, dtype=torch.float32)

    def reset_parameters(self) -> None:
        _fill(self.weight, self.full_weight())


def _fill(dst: torch.Tensor, full: torch.Tensor) -> None:
    """This rank's part of `full` into `dst` (a DTensor, a plain tensor, or nothing on meta)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if dst.device.type == "meta":
        return
    with torch.no_grad():
        if isinstance(dst, DTensor):  # each rank cuts its own chunk of its own copy, no communication
            dst.to_local().copy_(
                distribute_tensor(full.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None).to_local()
            )
        else:
            dst.copy_(full)


def _add_adapter(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    x = module.lora_dropout(args[0])
    return output + module.lora_B(module.lora_A(x)) * module.lora_scale


def is_adapter_part(module: nn.Module) -> bool:
    """Whether a module is an adapter's A or B (a linear of its own, not one of the base's)."""
    return isinstance(module, (LoraDown, LoraUp))


def carry_adapter(old: nn.Linear, new: nn.Module) -> None:
    """A base linear replaced by another module (float8's conversion swaps each for its own linear
    class): its adapter, scale and hook move to the new one; a linear without an adapter, nothing."""
    if not isinstance(getattr(old, "lora_A", None), LoraDown):
        return
    for name in ("lora_dropout", *ADAPTER_PARTS):
        new.add_module(name, getattr(old, name))
    new.lora_scale = old.lora_scale
    new.register_forward_hook(_add_adapter)


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key (or parameter FQN) is an adapter's, not the base model's."""
    parts = key.split(".")
    return any(p in ADAPTER_PARTS for p in parts[:-1])


def targets_of(model: nn.Module, acfg: AdapterConfig) -> list[str]:
    """The FQNs of the linears `adapter.targets` selects, in `named_modules` order; ConfigError
    for a selected module that is not an nn.Linear, or for globs that select none."""
    patterns = [glob_to_regex(g) for g in acfg.targets]
    out = []
    for fqn, m in model.named_modules():
        if not fqn or not any(p.match(fqn) for p in patterns) or isinstance(m, (LoraDown, LoraUp)):
            continue
        if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:  # (float8's, say: its own forward)
            raise ConfigError(
                f"adapter.targets={list(acfg.targets)}: {fqn} is a {type(m).__name__}, not an nn.Linear; "
                "LoRA wraps linears only: narrow the globs (e.g. '**.{q_proj,v_proj}')"
            )
        out.append(fqn)
    if not out:
        linears = sorted({f.rsplit(".", 1)[-1] for f, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"adapter.targets={list(acfg.targets)}: match no linear of the model "
            f"(its linears are named {', '.join(linears) or 'nothing: it has none'})"
        )
    return out


def apply_lora(model: nn.Module, acfg: AdapterConfig, seed: int) -> list[str]:
    """Give each target linear of `model` its adapter and freeze the rest (module docstring);
    the targets' FQNs.  A no-op for adapter=none."""
    if acfg.name != Adapter.lora:
        return []
    targets = targets_of(model, acfg)
    for fqn in targets:
        linear = model.get_submodule(fqn)
        device = linear.weight.device
        linear.lora_dropout = nn.Dropout(acfg.dropout) if acfg.dropout > 0 else nn.Identity()
        linear.lora_A = LoraDown(linear.in_features, acfg.rank, adapter_seed(seed, fqn), device)
        linear.lora_B = LoraUp(acfg.rank, linear.out_features, device)
        linear.lora_scale = acfg.alpha / acfg.rank
        linear.register_forward_hook(_add_adapter)
    trained = [glob_to_regex(g) for g in acfg.train]
    hit = [False] * len(trained)
    for name, p in model.named_parameters():
        if is_adapter_key(name):
            continue
        matches = [bool(r.match(name)) for r in trained]
        hit = [a or b for a, b in zip(hit, matches, strict=True)]
        p.requires_grad_(any(matches))
    missed = [g for g, h in zip(acfg.train, hit, strict=True) if not h]
    if missed:
        raise ConfigError(
            f"adapter.train: {missed[0]} matches no parameter of the model (FQN globs of parameters: '**.norm.weight')"
        )
    return targets


def init_adapters(model: nn.Module) -> int:
    """Fill every adapter's A and B (each rank its shards of them) once the model is allocated,
    whichever way its base was (a transformers model's tensors are left for its pretrained
    files: models/init.py).  The number of adapted linears."""
    parts = [m for m in model.modules() if isinstance(m, (LoraDown, LoraUp))]
    for m in parts:
        m.reset_parameters()
    return sum(isinstance(m, LoraDown) for m in parts)


@contextlib.contextmanager
def adapters_set_aside(module: nn.Module) -> Iterator[None]:
    """Detach the adapters of the linears under `module` for the block's duration: torch's colwise and
    rowwise styles treat each submodule of a linear as a linear (its dropout too), and split every
    parameter it holds by the linear's rule (registering them under dotted names, which nn.Module
    refuses); the adapters are split by `parallelize_adapter` instead."""
    parts = ("lora_dropout", *ADAPTER_PARTS)
    held = {}
    for m in module.modules():
        if isinstance(getattr(m, "lora_A", None), LoraDown):
            held[m] = [m._modules.pop(name) for name in parts]
    try:
        yield
    finally:
        for m, children in held.items():
            for name, child in zip(parts, children, strict=True):
                m.add_module(name, child)


def parallelize_adapter(linear: nn.Module, style: str, tp_mesh: Any) -> None:
    """Split the adapter of a linear that tensor parallelism has just split by `style`, so that the
    adapter's output is laid out as the base's and adds to it with no collective of its own:
    colwise (the base's output features split) keeps A whole (Replicate) and splits B by its rows,
    the adapter's output features; rowwise (the base's input features split, its output a partial
    sum reduced by the style's output hook, which runs after the adapter's) splits A by its columns,
    the input features, and keeps B whole, so the adapter's output is a partial sum reduced with the
    base's.  Nothing for a linear without an adapter."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if not isinstance(getattr(linear, "lora_A", None), LoraDown):
        return
    placements = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate())}[style]
    for part, placement in zip((linear.lora_A, linear.lora_B), placements, strict=True):
        w = part.weight  # each rank cuts its own copy (src_data_rank=None): A is drawn alike on every rank
        sharded = distribute_tensor(w.detach(), tp_mesh, [placement], src_data_rank=None)
        part.weight = nn.Parameter(sharded, requires_grad=w.requires_grad)


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if is_adapter_key(n)}


def frozen_names(model: nn.Module) -> set[str]:
    """The FQNs of the parameters that do not train (an adapter run's base): its checkpoints leave them out."""
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{`FQN.weight`: W + alpha / rank * B @ A} of every adapted linear, held as W is (a collective,
    every rank).  Where B is laid out as W (fully_shard alone: the same rows of both on each rank),
    each rank adds B's rows times A gathered whole; otherwise (tensor parallelism: a rowwise W's B is
    replicated over `tp`, and fully_shard then splits W and B on different dims) B is gathered too
    and the product cut to W's layout on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for fqn, m in model.named_modules():
        if not isinstance(getattr(m, "lora_A", None), LoraDown):
            continue
        a, w, b = m.lora_A.weight, m.weight, m.lora_B.weight
        a = a.full_tensor() if isinstance(a, DTensor) else a
        with torch.no_grad():
            if isinstance(w, DTensor):
                if isinstance(b, DTensor) and w.placements == b.placements and w.device_mesh == b.device_mesh:
                    local = w.to_local() + (m.lora_scale * (b.to_local() @ a)).to(w.dtype)
                else:
                    whole = (m.lora_scale * ((b.full_tensor() if isinstance(b, DTensor) else b) @ a)).to(w.dtype)
                    cut = distribute_tensor(whole, w.device_mesh, w.placements, src_data_rank=None)
                    local = w.to_local() + cut.to_local()
                out[f"{fqn}.weight"] = DTensor.from_local(
                    local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride()
                )
            else:
                out[f"{fqn}.weight"] = w + (m.lora_scale * (b @ a)).to(w.dtype)
    return out
