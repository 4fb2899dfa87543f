"""Hugging Face's Llama configuration and tensor names, both ways.

A `LlamaForCausalLM` directory's `config.json` gives composerun's model config
(`config_from_pretrained`), and a composerun Llama gives a `config.json` back
(`hf_config`).  The tensors' names differ only by Hugging Face's `model.` prefix (`lm_head`
has none): composerun's Llama uses transformers' module names and its half-rotation rotary
embedding, so no tensor is permuted or reshaped either way.  The rope settings are read
from the newer `rope_parameters` key or the older `rope_scaling` + `rope_theta`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from composerun.errors import ConfigError

LLAMA = "composerun.models.llama.Llama"
HF_CAUSAL = "composerun.models.hf_causal.HFCausalLM"  # +model=hf (models/hf_causal.py)
ARCHITECTURE = "LlamaForCausalLM"

# composerun model key (top-level or kwargs) <- config.json key
_TOP = {"dim": "hidden_size", "vocab_size": "vocab_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads"}
_KWARGS = {
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}
# Llama variants composerun's model does not have: key -> the only value it supports
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def hf_name(key: str) -> str:
    """The Hugging Face tensor name of a composerun Llama state-dict key."""
    return key if key.startswith("lm_head.") else f"model.{key}"


def our_name(key: str) -> str:
    """composerun's state-dict key of a Hugging Face Llama tensor name."""
    return key.removeprefix("model.")


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope scaling dict or None) from either spelling of a config.json."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConfigError(f"model.pretrained: config.json's {key} is {hf[key]!r}, not an object of rope settings")
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or {k: v for k, v in params.items() if k != "rope_theta"}
    try:
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    except (TypeError, ValueError):
        raise ConfigError(f"model.pretrained: config.json's rope_theta is not a number: {params or hf}") from None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"model.pretrained: rope type {kind!r} in config.json: composerun's Llama has default and llama3 rotary embeddings")
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keep if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ConfigError(f"model.pretrained: config.json's llama3 rope settings lack a number for {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in keep}}


def config_from_pretrained(directory: Path) -> dict[str, Any]:
    """The model config's values (top-level keys, and `kwargs`) that a Hugging Face Llama
    directory's config.json sets; ConfigError for a directory composerun cannot load."""
    from composerun.models.hf_causal import read_config_json  # (it imports torch: the command line does not)

    hf = read_config_json(directory)
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs and hf.get("model_type") != "llama":
        what = ", ".join(archs) or hf.get("model_type") or "no architecture"
        raise ConfigError(f"model.pretrained={directory}: config.json is for {what}; composerun loads {ARCHITECTURE} (Llama) directories")
    for k, want in _FIXED.items():
        if k in hf and hf[k] != want:
            raise ConfigError(f"model.pretrained={directory}: config.json has {k}={hf[k]!r}; composerun's Llama has {k}={want!r}")
    missing = [v for v in list(_TOP.values()) + ["intermediate_size"] if v not in hf]
    if missing:
        raise ConfigError(f"model.pretrained={directory}: config.json lacks {', '.join(missing)}")
    for v in [*_TOP.values(), *_KWARGS.values()]:
        want = bool if v == "tie_word_embeddings" else float if v == "rms_norm_eps" else int
        if hf.get(v) is not None and (not isinstance(hf[v], (want, int)) or isinstance(hf[v], bool) != (want is bool)):
            kind = {bool: "true or false", float: "a number", int: "an integer"}[want]
            raise ConfigError(f"model.pretrained={directory}: config.json's {v} is {hf[v]!r}, not {kind}")
    theta, scaling = rope_settings(hf)
    out: dict[str, Any] = {k: hf[v] for k, v in _TOP.items()}
    kwargs = {k: hf[v] for k, v in _KWARGS.items() if hf.get(v) is not None}
    kwargs.update(rope_theta=theta, rope_scaling=scaling)
    kwargs.setdefault("tie_embeddings", False)
    out["kwargs"] = kwargs
    return out


def apply_pretrained(cfg: DictConfig) -> None:
    """`model.pretrained=DIR`: fill every dimension the model option leaves null from
    DIR/config.json (`+model=llama3` leaves them all); one the option sets must agree.
    model.seq_len is at most the model's max_position_embeddings."""
    mcfg = cfg.get("model")
    if mcfg is not None and mcfg.get("_target_") == LLAMA and mcfg.get("dim") is None and not mcfg.get("pretrained"):
        raise ConfigError(
            f"model.pretrained: +model={mcfg.get('name')} takes every dimension from a Hugging Face model "
            "directory: give model.pretrained=DIR (or choose a preset such as +model=llama3_debug)"
        )
    if mcfg is not None and mcfg.get("_target_") == HF_CAUSAL:
        _apply_hf(mcfg)
        return
    if mcfg is None or not mcfg.get("pretrained"):
        return
    directory = Path(str(mcfg.pretrained)).expanduser()
    if mcfg.get("_target_") != LLAMA:
        raise ConfigError(f"model.pretrained: model._target_={mcfg.get('_target_')} has no Hugging Face equivalent; use +model=llama3")
    values = config_from_pretrained(directory)
    kwargs = values.pop("kwargs")
    with open_dict(mcfg):
        mcfg.pretrained = str(directory)  # `~` expanded once, for every later reader of the path
        for key, value in [*values.items(), *(("kwargs." + k, v) for k, v in kwargs.items())]:
            have = OmegaConf.select(mcfg, key)
            if have is None:
                OmegaConf.update(mcfg, key, value, force_add=True)
            elif _differs(have, value):
                raise ConfigError(
                    f"model.{key}={have} but {directory}/config.json says {value}: use +model=llama3 "
                    "(it takes every dimension from the directory) or drop model.pretrained"
                )
        # the option's training sequence length (llama3's 2048) is a default: a model made for
        # shorter sequences trains on all it takes (data.seq_len asks for another, checked)
        cap = OmegaConf.select(mcfg, "kwargs.max_seq_len")
        if isinstance(cap, int) and isinstance(mcfg.get("seq_len"), int) and mcfg.seq_len > cap:
            mcfg.seq_len = cap


def _apply_hf(mcfg: DictConfig) -> None:
    """`+model=hf model.pretrained=DIR`: DIR is checked (a causal LM transformers knows, remote
    code only where allowed) and its dimensions fill the model config's keys, which the
    estimate and the throughput read; the constructor gets DIR."""
    from composerun.models.hf_causal import dims_of, read_config, text_config
    if not mcfg.get("pretrained"):
        raise ConfigError("model.pretrained: +model=hf builds the model a Hugging Face directory describes: give model.pretrained=DIR")
    directory = Path(str(mcfg.pretrained)).expanduser()
    config = read_config(directory, bool(mcfg.get("trust_remote_code")))
    with open_dict(mcfg):
        mcfg.pretrained = str(directory)
        for key, value in dims_of(config).items():
            if mcfg.get(key) is not None and mcfg[key] != value:
                raise ConfigError(f"model.{key}={mcfg[key]} but {directory}/config.json says {value}: drop model.{key}")
            mcfg[key] = value
        OmegaConf.update(mcfg, "kwargs.config_dir", str(directory), force_add=True)
        OmegaConf.update(mcfg, "kwargs.trust_remote_code", bool(mcfg.get("trust_remote_code")), force_add=True)
        cap = getattr(text_config(config), "max_position_embeddings", None)
        if isinstance(cap, int) and isinstance(mcfg.get("seq_len"), int) and mcfg.seq_len > cap:
            mcfg.seq_len = cap


def _differs(have: Any, value: Any) -> bool:
    have = OmegaConf.to_container(have) if OmegaConf.is_config(have) else have
    if isinstance(value, float) or isinstance(have, float):
        return abs(float(have) - float(value)) > 1e-9 * max(1.0, abs(float(value)))
    return have != value


def hf_config(model: Any, dtype: str = "float32", source: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for a composerun Llama (`source`: the pretrained directory's, whose other
    keys, token ids say, are kept)."""
    scaling = model.rotary.scaling
    out = dict(source or {})
    out.update(
        architectures=[ARCHITECTURE],
        model_type="llama",
        vocab_size=model.vocab_size,
        hidden_size=model.dim,
        intermediate_size=model.layers[0].mlp.gate_proj.out_features if len(model.layers) else 4 * model.dim,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.layers[0].self_attn.n_kv_heads if len(model.layers) else model.n_heads,
        head_dim=model.head_dim,
        hidden_act="silu",
        rms_norm_eps=model.norm.eps,
        max_position_embeddings=model.max_seq_len,
        tie_word_embeddings=model.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype=dtype,
    )
    # both spellings: transformers >= 4.56 reads rope_parameters, older ones rope_scaling + rope_theta
    out["rope_theta"] = model.rotary.theta
    out["rope_scaling"] = dict(scaling) if scaling else None
    out["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": model.rotary.theta}
    return out
