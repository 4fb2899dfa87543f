"""The resolved config as the ranks (and every function below the command line) receive it:
the schema's own dataclasses, not nested dicts.  A misspelt field is an AttributeError at the
line that misspells it, and a value has the type its schema gives it (an Enum, not its name).

`checkpoint.async` (the CLI's name, a Python keyword) is the attribute `async_`.  `to_plain`
gives the JSON form back (enum values, `async`), for manifests and summaries, and
`config_changes` compares two of those (a checkpoint's config and the one a resume is given).
"""

from __future__ import annotations

import dataclasses
import functools
import json
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


# Keys whose change at a resume says nothing about what is trained, and that a run may well
# change when it goes on: which checkpoint is resumed and how and where checkpoints are written
# (checkpoint.*: `checkpoint.every`, `keep`, `async` change when state is saved, not the state;
# `init_from` is replaced by the checkpoint's weights), what is logged (metrics.*,
# train.log_every), what is profiled (profile.*), how the ranks are started (launch.*), plan-only mode, and the
# initialization seed (`train.seed`: the checkpoint's weights and RNG state replace what it
# would initialize).  The one list both the launcher's line and rank 0's log compare by.
NOT_COMPARED = ("checkpoint", "metrics", "profile", "launch", "plan", "train.log_every", "train.seed")
UNSET = "(unset)"


@dataclasses.dataclass(frozen=True)
class Change:
    """One key that differs between a checkpoint's config and the config given."""

    key: str  # dotted: `optim.weight_decay`, `sharding.rules[0].api`
    old: Any  # UNSET where only the other side has the key
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[Change]:
    """Every key, by dotted path, whose value differs between two configs in their JSON form
    (`to_plain`; a manifest's), leaving out NOT_COMPARED; a key only one side has is UNSET on
    the other.  A key the checkpoint's config lacks whose value here is the schema's default is
    no change: the checkpoint was written by a composerun from before the key (`adapter.*`, say),
    whose behaviour the default keeps.  Sorted by key."""
    old, new = _flatten(_json(before)), _flatten(_json(after))
    out = []
    for key in sorted(set(old) | set(new)):
        if any(key == p or key.startswith(p + ".") for p in NOT_COMPARED):
            continue
        a, b = old.get(key, UNSET), new.get(key, UNSET)
        if a != b and not (a == UNSET and _default(key) == (b,)):
            out.append(Change(key, a, b))
    return out


def _default(key: str) -> tuple[Any, ...]:
    """(the schema's default for a dotted key,) or () where it has none (`sharding.rules[3].backend`:
    a rule's field)."""
    rule = "[" in key  # sharding.rules[i].field
    field, defaults = (key.rsplit("].", 1)[-1], _defaults("rule")) if rule else (key, _defaults("config"))
    return (defaults[field],) if field in defaults else ()


@functools.cache
def _defaults(of: str) -> dict[str, Any]:
    from composerun.config.schema import RuleConfig

    return _flatten(_json(to_plain(RuleConfig() if of == "rule" else Config())))


def _json(obj: Any) -> Any:
    """As a manifest stores it (JSON), so that a tuple and a list of the same items agree."""
    return json.loads(json.dumps(obj, default=str))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value}; a list of dicts (sharding.rules) by index, `rules[0].api`; any
    other list is one value (mesh.shape).  An empty dict has no keys: `optim.kwargs={}` against
    `{fused: true}` is `optim.kwargs.fused (unset) -> true`."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and any(isinstance(x, dict) for x in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
