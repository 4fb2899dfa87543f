"""`api: float8`: the matched module's linears trained in float8 through torchao (an optional
extra: `pip install 'composerun[float8]'`), as torchtitan does.

torchao swaps each `nn.Linear` for its `Float8Linear` (dynamic tensorwise scaling: inputs,
weights and output gradients cast to float8 for the three matrix products).  A linear whose
dimensions are not both multiples of 16 cannot take float8's matrix product: it is skipped,
and the plan lists it with the reason.  Where `fully_shard` holds the module, FSDP
all-gathers the weights in float8 (half bf16's bytes; `float8_all_gather: false` turns it
off), and the weights' scales are computed for every unit at once after each optimizer step
(torchao's `precompute_float8_dynamic_scale_for_fsdp`).

float8's matrix products need a CUDA GPU of compute capability 8.9 or more (Ada, Hopper,
Blackwell): without one, a policy with float8 is a config error before any rank starts
(`plan=true` still plans it, for the GPUs it is meant for).  Each converted linear keeps the
initialization its own class gave it (composerun's Llama: N(0, std)), so a float8 run starts
from the same weights as a bf16 one.  With `adapter=lora`, the base linears convert and keep their
adapters (A and B stay linears of their own dtype: float8 is for the frozen base's products).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from composerun.errors import ConfigError
from composerun.models.lora import carry_adapter, is_adapter_part

MULTIPLE = 16  # float8 matrix products want both dimensions a multiple of 16
MIN_CAPABILITY = (8, 9)
# tests only: torchao's emulation of float8 matrix products, which runs on a CPU (no config key:
# a run on a CPU is refused before any rank starts)
EMULATE = False


def _skip_reason(module: nn.Linear) -> str | None:
    if module.in_features % MULTIPLE or module.out_features % MULTIPLE:
        return f"{module.in_features}x{module.out_features} is not a multiple of {MULTIPLE} in both dims"
    return None


def float8_targets(module: nn.Module, all_gather: bool | None) -> dict[str, Any]:
    """plan.json's view of a float8 rule on `module`: the linears it converts and those it
    skips (with why), by FQN relative to the module."""
    converted, skipped = [], {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and not is_adapter_part(m):  # (adapter=lora's A and B train in their own dtype)
            why = _skip_reason(m)
            if why is None:
                converted.append(name)
            else:
                skipped[name] = why
    if not converted:
        raise ConfigError(
            f"float8 converts the linears of a module, and {type(module).__name__} has none whose dimensions are "
            f"multiples of {MULTIPLE} (skipped: {skipped or 'no linears at all'})"
        )
    return {"converted": converted, "skipped": skipped, "all_gather": all_gather}


def check_float8_here(device: str) -> None:
    """float8 training runs here: a CUDA GPU of capability >= 8.9, torchao installed."""
    if device != "cuda" or not torch.cuda.is_available():
        raise ConfigError(
            "api: float8 trains float8 matrix products on a CUDA GPU of compute capability 8.9 or more (H100, L4, "
            "RTX 4090), and this run is on the CPU: remove the float8 rule (sharding=fsdp_blocks), or plan it "
            "with plan=true"
        )
    have = torch.cuda.get_device_capability()
    if have < MIN_CAPABILITY:
        raise ConfigError(
            f"api: float8 needs a CUDA GPU of compute capability 8.9 or more; {torch.cuda.get_device_name()} has "
            f"{have[0]}.{have[1]}: remove the float8 rule, or train in bf16 (sharding.param_dtype=bfloat16)"
        )
    _torchao()


def _torchao() -> Any:
    """torchao's float8 package, imported quietly: on a machine without its CUDA kernels torchao
    logs a line per kernel library it cannot load, and torch a deprecation per Enum it
    registers, none of which is the user's business."""
    import logging

    quiet = [logging.getLogger(n) for n in ("torch.utils._pytree", "torchao")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
    except ImportError:
        raise ConfigError("api: float8 needs torchao: pip install 'composerun[float8]'") from None
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return f8


def convert(module: nn.Module, options: dict[str, Any], all_gather: bool) -> None:
    """Swap the module's convertible linears for torchao's Float8Linear in place."""
    f8 = _torchao()
    converted = set(options["converted"])
    originals: dict[str, nn.Linear] = {}

    def keep(m: nn.Module, fqn: str) -> bool:
        if fqn in converted:
            originals[fqn] = m  # type: ignore[assignment]
            return True
        return False

    config = f8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=EMULATE)
    if module.__class__ is nn.Linear or (isinstance(module, nn.Linear) and "" in converted):
        raise ConfigError("api: float8 matches modules that hold linears (blocks), not a linear itself")
    f8.convert_to_float8_training(module, config=config, module_filter_fn=keep)
    subs = dict(module.named_modules())
    for fqn, old in originals.items():
        new = subs[fqn]
        _keep_initialization(old, new)
        carry_adapter(old, new)


def _keep_initialization(old: nn.Linear, new: nn.Module) -> None:
    """The converted linear initializes as its original class did (its reset_parameters and
    the attributes it reads), not as nn.Linear's Kaiming default."""
    own = type(old).reset_parameters
    if own is nn.Linear.reset_parameters:
        return
    for key, value in vars(old).items():
        if not key.startswith("_") and key not in vars(new) and not isinstance(value, (torch.Tensor, nn.Module)):
            setattr(new, key, value)
    new.reset_parameters = types.MethodType(own, new)


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step: every float8-all-gathered weight's scale in one pass."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
