"""Models composerun ships: torch's composable-API reference models and a small transformer.

`build_model(cfg.model)` builds any of them, or a user's nn.Module named by `_target_`; with
`cfg.adapter` (adapter=lora) its target linears get their adapters and the rest is frozen (lora.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composerun.config.schema import AdapterConfig, ModelConfig, target_class
from composerun.errors import ConfigError

if TYPE_CHECKING:  # torch is imported by the models themselves, not by the config's checks (models/hf.py)
    import torch.nn as nn

# Keys of the model config that are passed to the constructor when not null.
CTOR_KEYS = ("dim", "vocab_size", "fusion_vocab_size", "n_layers", "n_heads")


def build_model(mcfg: ModelConfig, adapter: AdapterConfig | None = None, seed: int = 0) -> nn.Module:
    """The model `mcfg` configures; with `adapter`, adapted (models/lora.py; `seed`: train.seed, A's)."""
    import torch.nn as nn

    cls = target_class("model._target_", mcfg._target_)
    kwargs = {k: getattr(mcfg, k) for k in CTOR_KEYS if getattr(mcfg, k) is not None}
    kwargs.update(mcfg.kwargs)
    try:
        model = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model._target_={mcfg._target_}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={mcfg._target_} built a {type(model).__name__}, not an nn.Module")
    if adapter is not None:
        from composerun.models.lora import apply_lora

        apply_lora(model, adapter, seed)
    return model
