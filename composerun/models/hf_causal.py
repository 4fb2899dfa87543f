"""Any Hugging Face causal LM, through transformers' own modules (`+model=hf model.pretrained=DIR`).

The model is the class transformers names for DIR/config.json (`AutoModelForCausalLM`),
built from that config as it is: composerun never rewrites a value of it.  Its parameters
are made on the meta device while its buffers are real: transformers computes non-persistent
buffers (rotary `inv_freq` and the like) in the constructors, from the config, and a model
built wholly on meta would keep nothing of them.  They are kept aside when the model is built
and put back after the sharded model is allocated (`materialize`), so a run never trains with
a rotary table that meta-device building zeroed; the parameters (and any persistent buffer)
come from DIR's safetensors files, each rank reading its rows (checkpoint/hf_import.py).

The root module is transformers' model itself, so the state-dict keys are the directory's own
tensor names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), under every policy.
A forward hook makes its output the logits tensor that composerun's loss takes, and the config's
`use_cache` is off (training keeps no key/value cache; and without a cache or an
attention_mask, transformers reads packed documents from the `position_ids` data=sft's packed
rows pass, restarting at each document, and attends within each document only).  With tied embeddings `lm_head.weight`
is `model.embed_tokens.weight` (one parameter), which the files do not store twice.  Where
transformers fuses tensors the files keep apart (a mixture of experts' experts), which file
tensors make each parameter is recorded as the model is built (models/hf_layout.py).

transformers is an optional dependency (`composerun[hf]`): it is imported only here, when a
model of this kind is configured.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from composerun.errors import ConfigError
from composerun.models.hf_layout import remember

HF_TARGET = "composerun.models.hf_causal.HFCausalLM"  # (models/hf.py names it too: HF_CAUSAL)

# the non-persistent buffers of each model built here, as its constructors computed them
_BUFFERS: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def read_config_json(directory: Path, key: str = "model.pretrained") -> dict[str, Any]:
    path = directory / "config.json"
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "no such directory"
        raise ConfigError(f"{key}={directory}: {what}; give a Hugging Face model directory")
    if not path.is_file():
        raise ConfigError(f"{key}={directory}: no config.json there; give a Hugging Face model directory (config.json + *.safetensors)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path} is not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key}: {path} holds a JSON {type(hf).__name__}, not a model's config (an object)")
    return hf


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("+model=hf needs transformers, which is not installed: pip install 'composerun[hf]'") from None
    return transformers


def read_config(directory: Path, trust_remote_code: bool = False) -> Any:
    """transformers' config of DIR, checked: a known model type (or remote code allowed), a
    causal LM; ConfigError in one line otherwise."""
    raw = read_config_json(directory)
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    what = f"model.pretrained={directory}"
    remote = "AutoModelForCausalLM" in (raw.get("auto_map") or {}) or (
        raw.get("auto_map") and raw.get("model_type") not in CONFIG_MAPPING_NAMES
    )
    if remote and not trust_remote_code:
        raise ConfigError(
            f"{what}: config.json names code of the directory's own (auto_map); composerun runs it only "
            "with model.trust_remote_code=true (read that code first)"
        )
    kind = raw.get("model_type")
    if not remote and kind not in CONFIG_MAPPING_NAMES:
        raise ConfigError(
            f"{what}: config.json's model_type {kind!r} is not one transformers {tf.__version__} knows; "
            "upgrade transformers or give a directory of a known architecture"
        )
    if not remote and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(raw.get("architectures") or []) or kind
        raise ConfigError(
            f"{what}: config.json is for {archs}, not a causal language model "
            "(transformers has no AutoModelForCausalLM class for it)"
        )
    try:
        return tf.AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{what}: transformers cannot read config.json ({' '.join(str(e).split())})") from None


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config holds it apart; a text model's is itself)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a constructor registers goes to the meta device; buffers stay real.
    (Each parameter is made, then dropped as it is registered: no more than one at a time.)"""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class HFCausalLM:
    """`_target_` of `+model=hf`: calling it builds transformers' causal LM for `config_dir`
    (an instance of transformers' class, not of this one).  Under the meta device (how
    composerun builds models) its parameters are on meta and its buffers real (module
    docstring); otherwise it is built whole, with transformers' random initialization.
    The dimension keys (model.dim, ...) are those of config.json, which the launcher fills."""

    def __new__(  # type: ignore[misc]
        cls,
        config_dir: str,
        trust_remote_code: bool = False,
        attn_implementation: str = "sdpa",
        **dims: Any,
    ) -> nn.Module:
        tf = _transformers()
        config = read_config(Path(config_dir), trust_remote_code)
        _check_dims(config, dims)
        config.use_cache = False
        text_config(config).use_cache = False
        on_meta = torch.empty(0).device.type == "meta"
        build = dict(trust_remote_code=trust_remote_code, attn_implementation=attn_implementation)
        if on_meta:
            with torch.device("cpu"), _parameters_on_meta():
                model = tf.AutoModelForCausalLM.from_config(config, **build)
            buffers = dict(non_persistent_buffers(model))
            _BUFFERS[model] = {k: v.detach().clone() for k, v in buffers.items()}
            for fqn, buf in model.named_buffers():  # the structure on meta; the values kept aside
                _set_buffer(model, fqn, buf.to("meta"))
        else:
            model = tf.AutoModelForCausalLM.from_config(config, **build)
        model.register_forward_hook(_logits)
        _experts_on_fake_tensors()
        tied = tied_keys(model)
        remember(model, {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items() if k not in tied})
        return model


def _experts_on_fake_tensors() -> None:
    """transformers' grouped experts (a mixture of experts) call torch's grouped_mm, whose fake
    kernel takes bfloat16 only, as CUDA's does: on fake tensors in another dtype (plan=true's
    estimate) they take transformers' own fallback op instead, whose shapes fake tensors know.
    Real tensors go as transformers sends them, and so do torch.compile's (its tracing is left
    to transformers' own choice)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return
    can_use = getattr(moe, "_can_use_grouped_mm", None)
    if can_use is None or getattr(can_use, "composerun", False):
        return
    from composerun._torch_compat import is_fake

    def grouped_mm_unless_fake(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        if not torch.compiler.is_compiling() and is_fake(weight) and weight.dtype != torch.bfloat16:
            return False
        return bool(can_use(input, weight, offs))

    grouped_mm_unless_fake.composerun = True  # type: ignore[attr-defined]
    moe._can_use_grouped_mm = grouped_mm_unless_fake


def _logits(module: nn.Module, args: Any, output: Any) -> torch.Tensor:
    """The causal LM's output, reduced to the logits (composerun's loss takes them)."""
    return output.logits if hasattr(output, "logits") else output[0]


def _check_dims(config: Any, dims: dict[str, Any]) -> None:
    have = dims_of(config)
    unknown = sorted(set(dims) - set(have))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (transformers' config.json sets the model)")
    for key, value in dims.items():
        if value is not None and value != have[key]:
            raise ConfigError(f"model.{key}={value} but config.json says {have[key]}: drop model.{key}")


def dims_of(config: Any) -> dict[str, int]:
    """The model config's dimension keys that a transformers config gives."""
    text = text_config(config)
    return {"dim": text.hidden_size, "vocab_size": text.vocab_size, "n_layers": text.num_hidden_layers,
            "n_heads": text.num_attention_heads}  # fmt: skip


def non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _set_buffer(model: nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner, _, name = fqn.rpartition(".")
    model.get_submodule(owner)._buffers[name] = value


def is_hf(model: nn.Module) -> bool:
    """Whether `model` was built here on the meta device (then `materialize` allocates it)."""
    return model in _BUFFERS


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) model on `device` and put back the non-persistent buffers its
    constructors computed; the parameters are left to the pretrained files.  Allocation makes
    a new parameter per module, so a tied one is tied again (one tensor, as before)."""
    ties = _ties(model)
    model.to_empty(device=device)
    for fqn, value in _BUFFERS[model].items():
        _set_buffer(model, fqn, value.to(device))
    for alias, source in ties.items():
        owner, _, name = alias.rpartition(".")
        model.get_submodule(owner)._parameters[name] = model.get_parameter(source)


def _ties(model: nn.Module) -> dict[str, str]:
    """{parameter name: the first name of the same parameter} for each tied parameter."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        first.setdefault(id(p), name)
    return out


def tied_keys(model: nn.Module) -> set[str]:
    """The state-dict keys whose tensor is another key's (tied embeddings): stored once."""
    seen: set[int] = set()
    out = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            if id(t) in seen:
                out.add(key)
            seen.add(id(t))
    return out


def tied_in_directory(directory: Path) -> set[str]:
    """The tensor names that the model of DIR ties to another (its files need not store them),
    from config.json and transformers' class for it; no model is built."""
    raw = read_config_json(directory)
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = raw.get("model_type")
    tie = raw.get("tie_word_embeddings")
    if tie is None and kind in CONFIG_MAPPING:  # the architecture's default
        tie = getattr(CONFIG_MAPPING[kind](), "tie_word_embeddings", False)
    if not tie:
        return set()
    cls = getattr(tf, str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)), None)
    return set(getattr(cls, "_tied_weights_keys", None) or ["lm_head.weight"])
