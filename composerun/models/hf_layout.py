"""Where each tensor of a transformers model (`+model=hf`) lies in its directory's safetensors
files, as transformers itself saves and loads them.

Most tensors are stored whole under their own names.  transformers 5 fuses some as it loads:
a mixture-of-experts layer holds one parameter per projection for all its experts
(`mlp.experts.gate_up_proj`, experts x 2*intermediate x hidden), while the files hold one
tensor per expert and projection (`mlp.experts.3.gate_proj.weight`, `...up_proj.weight`), and
some families rename a block as well (Mixtral's files say `block_sparse_moe` for `mlp`).

The layout is asked of transformers, never written here per family: its save path
(`revert_weight_conversion`, run on meta tensors, so names and shapes only) gives the files'
names, its load path (`rename_source_key`, what `from_pretrained` applies to each name) the
parameter each one becomes, and its conversion's operations how the pieces are put together.
composerun takes the one composition that keeps each row of dim 0 whole, so that the rows a
rank holds under FSDP (whole experts) come from whole file tensors: the experts stacked along
dim 0 (`MergeModulelist(dim=0)`), in the files' natural order (`experts.10` after `experts.9`,
as transformers sorts them), then, within an expert, its projections concatenated in the
conversion's order (`Concatenate`).  A model whose files transformers converts in any other
way is refused in one line when it is built, before any rank reads a byte.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from composerun.errors import ConfigError

log = logging.getLogger("composerun")


@dataclass(frozen=True)
class Part:
    """A file tensor that is a piece of the model tensor `key`: its row `row` of dim 0 (one
    expert), and of that row the slice [start, stop) along the row's dim `dim`."""

    key: str
    row: int
    dim: int
    start: int
    stop: int

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        """The file tensor's shape, of the model tensor's shape `whole`."""
        row = list(whole[1:])
        row[self.dim] = self.stop - self.start
        return tuple(row)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of the model tensor (or of rows of it whose first is this row)."""
        return tensor[self.row].narrow(self.dim, self.start, self.stop - self.start)


# {file tensor name: the model's state-dict key it is (whole), or the Part of one it is}
Layout = dict[str, "str | Part"]

# the layout of each transformers model built by models/hf_causal.py, from its unwrapped class
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


def remember(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Record the layout of a model just built (before a policy wraps its class, whose name
    transformers looks its conversions up by); `shapes`: the tensors its files store."""
    _LAYOUTS[model] = layout_of(model, shapes)


def file_layout(model: nn.Module) -> Layout | None:
    """The recorded layout of a transformers model; None for a model built elsewhere."""
    return _LAYOUTS.get(model)


def layout_of(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> Layout:
    """Each file tensor's place in the model (the module's docstring); `shapes`: the model's
    state-dict keys that its files store (a tied one left out) and their shapes."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
            revert_weight_conversion,
        )
    except ImportError:  # a transformers that converts nothing: every tensor under its own name
        return {k: k for k in shapes}
    try:
        saved = revert_weight_conversion(model, {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
        # (a conversion that cannot run on meta tensors: the files are taken to hold the model's own
        # names, which the check of the files then holds them to, in one line if they do not)
        log.warning("%s: transformers' save layout unknown (%s); reading the model's own tensor names", _what(model), e)
        return {k: k for k in shapes}
    if set(saved) == set(shapes):
        return {k: k for k in shapes}
    # what save_pretrained reverses (a PrefixChange only where from_pretrained saw the prefix)
    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out: Layout = {}
    pieces: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name in sorted(saved, key=dot_natural_key):
        key, pattern = rename_source_key(name, renamings, converters)
        if key not in shapes:
            raise ConfigError(f"{_what(model)}: transformers loads its files' {name} into {key}, which the model lacks")
        if pattern is None:
            out[name] = key
        else:
            pieces[key][pattern].append(name)
    stored = {n: tuple(t.shape) for n, t in saved.items()}
    for key, by_pattern in pieces.items():
        converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
        out.update(_parts(model, key, shapes[key], converter, by_pattern, stored))
    return out


def _parts(model: nn.Module, key: str, shape: tuple[int, ...], converter: Any, by_pattern: dict[str, list[str]],
           saved: dict[str, tuple[int, ...]]) -> Layout:  # fmt: skip
    """The Parts of `key`: row e of each pattern's e-th file tensor, the patterns side by side
    along the row's dim the conversion concatenates (a ConfigError for any other conversion)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    merged = bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0 and len(shape) >= 2
    if merged and len(ops) == 1 and len(by_pattern) == 1:
        dim = 0
    elif merged and len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        dim = ops[1].dim - 1
    else:
        names = ", ".join(type(op).__name__ for op in ops)
        raise ConfigError(
            f"{_what(model)}: transformers builds its tensor {key} from its files by {names}; composerun reads only "
            "tensors stacked along dim 0 (MergeModulelist), then concatenated (Concatenate)"
        )
    out: Layout = {}
    at = 0
    for pattern in (p for p in converter.source_patterns if p in by_pattern):
        names = by_pattern[pattern]
        width = saved[names[0]][dim] if saved[names[0]] else 0
        for row, name in enumerate(names):
            out[name] = part = Part(key, row, dim, at, at + width)
            if len(names) != shape[0] or saved[name] != part.shape(shape):
                raise ConfigError(
                    f"{_what(model)}: transformers saves {key} {tuple(shape)} as {len(names)} tensors of shape "
                    f"{saved[name]} ({name}, ...), which composerun cannot put together row by row"
                )
        at += width
    if at != shape[1 + dim]:
        raise ConfigError(f"{_what(model)}: the pieces of {key} that transformers saves do not make its shape {shape}")
    return out


def _what(model: nn.Module) -> str:
    return f"model.pretrained ({type(model).__name__})"
