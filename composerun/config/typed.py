"""The resolved config as the ranks (and every function below the command line) receive it:
the schema's own dataclasses, not nested dicts.  A misspelt field is an AttributeError at the
line that misspells it, and a value has the type its schema gives it (an Enum, not its name).

`checkpoint.async` (the CLI's name, a Python keyword) is the attribute `async_`.  `to_plain`
gives the JSON form back (enum values, `async`), for manifests and summaries.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf

from composerun.config.schema import Config

# attribute name -> config key, where the two differ
_KEYS = {"async_": "async"}


def config_key(field: str) -> str:
    """The key a schema field has in the config (`async_` is `checkpoint.async`)."""
    return _KEYS.get(field, field)


def to_typed(cfg: DictConfig | dict[str, Any], cls: type = Config) -> Any:
    """A composed (and validated) config as an instance of its schema `cls`."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    return _build(cls, plain)


def _build(cls: type, value: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = _KEYS.get(f.name, f.name)
        if key in value:
            kwargs[f.name] = _value(hints[f.name], value[key])
    return cls(**kwargs)


def _value(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None
        return _value(next(a for a in args if a is not type(None)), v)
    if dataclasses.is_dataclass(tp):
        return v if isinstance(v, tp) else _build(tp, v)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return v if isinstance(v, tp) else tp(v)
    if origin is list:
        return [_value(args[0], x) for x in v]
    if origin is dict:
        return dict(v)
    return v


def to_plain(obj: Any) -> Any:
    """The JSON form of a typed config (or any part of it): dicts, lists, enum values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {_KEYS.get(f.name, f.name): to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


# Keys whose change at a resume says nothing about what is trained.
_NOT_COMPARED = ("checkpoint.resume", "checkpoint.start_over", "launch.", "metrics.", "plan")


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every leaf that differs (keys only one side has too)."""
    flat_before, flat_after = _flatten(before), _flatten(after)
    out = []
    for key in sorted(set(flat_before) | set(flat_after)):
        if key.startswith(_NOT_COMPARED):
            continue
        old, new = flat_before.get(key, "(unset)"), flat_after.get(key, "(unset)")
        if old != new:
            out.append(f"{key} {old} -> {new}")
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out
