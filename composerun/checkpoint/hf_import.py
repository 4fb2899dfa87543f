"""Hugging Face Llama weights in: `model.pretrained=DIR` reads the initial weights from DIR's
safetensors files, `model.safetensors` or the several that `model.safetensors.index.json`
lists, on any mesh and policy.

Each rank reads only the rows of dim 0 that it holds of each tensor (safetensors'
`get_slice`, through init_from's reader in export.py), so under FSDP over N ranks a rank reads
1/N of the model, one tensor's rows at a time, and no rank holds the whole model.  The tensor
names are Hugging Face's (`model.` prefix; models/hf.py maps them).  A tied model has no
`lm_head` (its output projection is `embed_tokens`): an `lm_head.weight` in the files, which
some tied directories hold, is ignored; so is a stored rotary `inv_freq` (older exports hold
one), which composerun computes from config.json.

The files are checked before any rank starts (launch/preflight.py) and again by rank 0 before
the ranks read: the headers only (8-byte length + JSON), never tensor data.  Every tensor the
model has must be there with its shape, nothing else may be, and every file must be a whole
safetensors file; each mistake is one line naming the file or the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from composerun.checkpoint.export import fill, model_tensors
from composerun.checkpoint.safetensors_io import Source
from composerun.errors import CheckpointError, ConfigError
from composerun.models.hf import hf_name, our_name

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_IGNORED = (".rotary_emb.inv_freq",)  # derived from config.json; older exports stored it
# bytes per element of each safetensors dtype (a header's sizes are checked against its shapes)
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def weights_path(directory: Path) -> Path:
    """The file the weights are read through: model.safetensors, else the index."""
    for name in (SINGLE, INDEX):
        if (directory / name).is_file():
            return directory / name
    raise ConfigError(
        f"model.pretrained={directory}: no {SINGLE} or {INDEX} there; composerun reads a Hugging Face "
        "directory's safetensors weights (save the model with safe_serialization=True)"
    )


def read_header(path: Path, what: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors file's header (its first 8 + n bytes); a
    ConfigError naming the file when it is unreadable, not safetensors, or shorter than its
    header says (truncated)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            first = f.read(8)
            n = struct.unpack("<Q", first)[0] if len(first) == 8 else None
            text = f.read(n) if n is not None and n <= size - 8 else None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path} ({e.strerror or e})") from None
    if text is None:
        raise ConfigError(f"{what}: {path} is truncated or not a safetensors file ({size} bytes, no whole header)")
    try:
        header = json.loads(text)
        shapes, end = {}, 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            shape, (begin, stop) = tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            if stop - begin != math.prod(shape) * _ITEMSIZE[entry["dtype"]]:
                raise ValueError(f"{key}'s byte range does not fit its shape")
            shapes[key], end = shape, max(end, stop)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{what}: {path} is not a safetensors file (its header: {e})") from None
    if 8 + n + end > size:
        raise ConfigError(f"{what}: {path} is truncated ({size} bytes; its header describes {8 + n + end})")
    return shapes


def stored_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Each stored tensor's Hugging Face name, shape and file, from headers alone."""
    what, path = f"model.pretrained={directory}", weights_path(directory)
    if path.name == SINGLE:
        return {k: (s, path) for k, s in read_header(path, what).items()}
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        files = {str(k): directory / str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{what}: {path} is not a readable safetensors index ({e!r})") from None
    headers = {}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise ConfigError(f"{what}: {INDEX} names {file.name}, which is not there")
        headers[file] = read_header(file, what)
    out = {}
    for key, file in files.items():
        if key not in headers[file]:
            raise ConfigError(f"{what}: {INDEX} names {file.name} for {key}, which it does not hold")
        out[key] = (headers[file][key], file)
    return out


def check_pretrained(directory: Path, want: dict[str, tuple[int, ...]]) -> None:
    """ConfigError unless DIR's files hold exactly the model's tensors (`want`: composerun's
    state-dict keys and shapes), with their shapes: one line naming the first misfit."""
    what = f"model.pretrained={directory}"
    stored = {k: v for k, v in stored_shapes(directory).items() if not k.endswith(_IGNORED)}
    if "lm_head.weight" not in want:  # tied: the output projection is embed_tokens
        stored.pop("lm_head.weight", None)
    have = {our_name(k): v for k, v in stored.items()}
    missing = [k for k in want if k not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"{what}: tensor {hf_name(missing[0])}{more} is missing from its safetensors files; "
            "the model its config.json describes has it"
        )
    extra = [k for k in have if k not in want]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(
            f"{what}: {have[extra[0]][1].name} holds tensor {hf_name(extra[0])}{more}, which the model its "
            "config.json describes has no place for"
        )
    for key, shape in want.items():
        stored_shape, file = have[key]
        if tuple(stored_shape) != tuple(shape):
            raise ConfigError(
                f"{what}: tensor {hf_name(key)} in {file.name} has shape {tuple(stored_shape)}; the model its "
                f"config.json describes has {tuple(shape)}"
            )


def check_sources(init_from: str | None, pretrained: str | None) -> None:
    """The initial weights come from one place."""
    if init_from and pretrained:
        raise ConfigError(
            f"checkpoint.init_from={init_from} and model.pretrained={pretrained} both give the initial "
            "weights: drop one (model.pretrained also gives the model's dimensions)"
        )


def load_pretrained(model: torch.nn.Module, directory: Path) -> None:
    """The (sharded) model's weights from DIR: rank 0 checks the headers first (one error for
    every rank), then each rank reads the rows it holds of each tensor."""
    targets = model_tensors(model)
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            check_pretrained(directory, {k: tuple(v.shape) for k, v in targets.items()})
        except ConfigError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
    try:
        src = Source(weights_path(directory), f"model.pretrained={directory}")
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    fill(targets, src, hf_name)
