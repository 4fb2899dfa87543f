"""Hugging Face Llama weights in: `model.pretrained=DIR` reads the initial weights from DIR's
safetensors files, `model.safetensors` or the several that `model.safetensors.index.json`
lists, on any mesh and policy.

Each rank reads only the rows of dim 0 that it holds of each tensor (`pread` of their byte
range, which the header gives) straight into its shards where the stored dtype is the
model's, else into a buffer of their size, copied and dropped (init_from's `fill`,
export.py): under FSDP over N ranks a rank reads 1/N of the model and holds, beyond its
shards, at most one tensor's rows at a time (BENCHMARKS.md).  The file is not mapped:
safetensors' `get_slice` leaves each slice's pages, and the kernel's read-around, in the
rank's resident set until the file is closed, about twice the rank's share.

The tensor names are Hugging Face's (`model.` prefix; models/hf.py maps them for composerun's
Llama; a transformers model, `+model=hf`, has them as they are: `names`).  Where transformers
fuses several file tensors into one parameter (a mixture of experts' experts), the rows a rank
holds are read from those experts' file tensors alone (`LaidOut`, by models/hf_layout.py).
Such a model is then checked against transformers' own forward (`check_first_forward`)
before it trains.  A tied model
has no `lm_head` (its output projection is `embed_tokens`): an `lm_head.weight` in the files,
which some tied directories hold, is ignored; so is a stored rotary `inv_freq` (older exports
hold one), which composerun computes from config.json.  A run that resumes a checkpoint does
not read the weights (the checkpoint's replace them: train/setup.py).

The files are checked before any rank starts (launch/preflight.py) and again by rank 0 before
the ranks read: the headers only (8-byte length + JSON), never tensor data.  Every tensor the
model has must be there with its shape, nothing else may be, and every file must be a whole
safetensors file; each mistake is one line naming the file or the tensor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composerun.checkpoint.export import fill, model_tensors
from composerun.checkpoint.safetensors_io import DTYPES
from composerun.errors import CheckpointError, ConfigError
from composerun.models.hf import hf_name, our_name
from composerun.models.hf_causal import is_hf, tied_in_directory, tied_keys
from composerun.models.hf_layout import Layout, Part, file_layout
from composerun.models.lora import is_adapter_key

log = logging.getLogger("composerun")

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
    return {k: shape for k, (shape, _, _) in _entries(path, what).items()}


def _entries(path: Path, what: str) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """Each tensor's (shape, dtype, offset of its first byte in the file) from the header."""
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
        entries, end = {}, 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            shape, (begin, stop) = tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            if stop - begin != math.prod(shape) * _ITEMSIZE[entry["dtype"]]:
                raise ValueError(f"{key}'s byte range does not fit its shape")
            entries[key], end = (shape, entry["dtype"], 8 + n + int(begin)), max(end, stop)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{what}: {path} is not a safetensors file (its header: {e})") from None
    if 8 + n + end > size:
        raise ConfigError(f"{what}: {path} is truncated ({size} bytes; its header describes {8 + n + end})")
    return entries


def stored_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], Path, str, int]]:
    """Each stored tensor's Hugging Face name: (shape, file, dtype, offset of its first byte),
    from headers alone."""
    what, path = f"model.pretrained={directory}", weights_path(directory)
    if path.name == SINGLE:
        return {k: (s, path, dtype, at) for k, (s, dtype, at) in _entries(path, what).items()}
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        files = {str(k): directory / str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{what}: {path} is not a readable safetensors index ({e!r})") from None
    headers = {}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise ConfigError(f"{what}: {INDEX} names {file.name}, which is not there")
        headers[file] = _entries(file, what)
    out = {}
    for key, file in files.items():
        if key not in headers[file]:
            raise ConfigError(f"{what}: {INDEX} names {file.name} for {key}, which it does not hold")
        shape, dtype, at = headers[file][key]
        out[key] = (shape, file, dtype, at)
    return out


def check_pretrained(directory: Path, want: dict[str, tuple[int, ...]], layout: Layout | None = None) -> None:
    """ConfigError unless DIR's files hold exactly the model's tensors (`want`: composerun's
    state-dict keys and shapes), with their shapes: one line naming the first misfit.  With a
    transformers model's `layout` (models/hf_layout.py), the files' tensors are the ones it
    names (an expert's projection, ...), or a split tensor whole under the model's own name."""
    what = f"model.pretrained={directory}"
    hf_name, our_name = names(want)
    stored = {k: v for k, v in stored_shapes(directory).items() if not k.endswith(_IGNORED)}
    if layout is not None:
        want = files_wanted(layout, want, set(stored))
    if hf_name is _same:  # transformers' model: the tensors it ties to another are not read
        tied = tied_in_directory(directory)
        want = {k: v for k, v in want.items() if k not in tied}
        stored = {k: v for k, v in stored.items() if k not in tied}
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
        stored_shape, file, dtype, _ = have[key]
        if tuple(stored_shape) != tuple(shape):
            raise ConfigError(
                f"{what}: tensor {hf_name(key)} in {file.name} has shape {tuple(stored_shape)}; the model its "
                f"config.json describes has {tuple(shape)}"
            )
        if dtype not in DTYPES.values():
            raise ConfigError(
                f"{what}: tensor {hf_name(key)} in {file.name} is {dtype}, which composerun does not read"
            )


def _same(key: str) -> str:
    return key


def files_wanted(layout: Layout, want: dict[str, tuple[int, ...]], stored: set[str]) -> dict[str, tuple[int, ...]]:
    """The file tensors (names and shapes) that hold the model's tensors `want`, by `layout`;
    files that hold a tensor under the model's own name instead (fused, or not renamed: as
    from_pretrained takes them too) are read under it."""
    out = {}
    for name, place in layout.items():
        key = place.key if isinstance(place, Part) else place
        if key not in want:  # (a tied tensor: not stored)
            continue
        if key in stored and name not in stored:
            out[key] = want[key]
        else:
            out[name] = place.shape(want[key]) if isinstance(place, Part) else want[key]
    return out


def names(keys: Any) -> tuple[Any, Any]:
    """(our key -> the files' name, and back) for a model's state-dict keys.  composerun's
    Llama keeps transformers' module names without the `model.` prefix, and is the one model
    with its embedding at the top (`embed_tokens.weight`); a transformers model
    (`+model=hf`) has the files' own names."""
    return (hf_name, our_name) if "embed_tokens.weight" in keys else (_same, _same)


def check_sources(init_from: str | None, pretrained: str | None) -> None:
    """The initial weights come from one place."""
    if init_from and pretrained:
        raise ConfigError(
            f"checkpoint.init_from={init_from} and model.pretrained={pretrained} both give the initial "
            "weights: drop one (model.pretrained also gives the model's dimensions)"
        )


def load_pretrained(model: torch.nn.Module, directory: Path, verify: bool = True) -> None:
    """The (sharded) model's weights from DIR: rank 0 checks the headers first (one error for
    every rank), then each rank reads the rows it holds of each tensor.  A transformers model
    (`+model=hf`) is then checked against transformers' own (`verify`: `check_first_forward`).
    (A run resuming a checkpoint does not call this: train/setup.py.)"""
    tied = tied_keys(model)  # (transformers' lm_head.weight where tied: embed_tokens' own tensor)
    # (an adapter's tensors are not the base model's: models/lora.py initializes them)
    targets = {k: v for k, v in model_tensors(model).items() if k not in tied and not is_adapter_key(k)}
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            check_pretrained(directory, {k: tuple(v.shape) for k, v in targets.items()}, file_layout(model))
        except ConfigError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
    layout = file_layout(model)
    reader = RowReader(directory)
    try:
        fill(targets, reader if layout is None else LaidOut(reader, layout, targets), names(targets)[0])
    finally:
        reader.close()
    log.info("model.pretrained: the initial weights are %s's (%d tensors)", directory, len(targets))
    if verify and is_hf(model):
        check_first_forward(model, directory)


PROBE_TOKENS = 32  # the probe sequence's length (or the model's max_position_embeddings)
# of the logits' largest magnitude, by the dtype the model computed them in: float32 is transformers'
# own arithmetic (its order of sums apart), bf16/fp16 (a policy's param_dtype) differ by their rounding
PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4}
PROBE_RTOL_LOW = 0.03


def check_first_forward(model: torch.nn.Module, directory: Path) -> None:
    """Stop the run, in one line, unless the loaded model's logits of a probe sequence (fixed
    random tokens) are those of transformers' model loaded from DIR by its own `from_pretrained`
    (rank 0, on the host, in float32).  A silently wrong initialization (a rotary table that
    meta-device building zeroed, a config value overridden by a default) would otherwise train
    a model that is not the pretrained one."""
    from transformers import AutoModelForCausalLM

    from composerun.models.hf_causal import text_config

    config = text_config(model.config)
    n = min(PROBE_TOKENS, getattr(config, "max_position_embeddings", PROBE_TOKENS) or PROBE_TOKENS)
    probe = torch.randint(config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    device = next(model.parameters()).device
    with torch.no_grad():
        ours = model(probe.to(device))
        ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
    rtol = PROBE_RTOL.get(ours.dtype, PROBE_RTOL_LOW)
    ours = ours.float().cpu()
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        trust = bool(getattr(model.config, "auto_map", None))  # (building the model was allowed)
        ref_model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, trust_remote_code=trust)
        with torch.no_grad():
            ref = ref_model(input_ids=probe, use_cache=False).logits.float()
        del ref_model
        diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
        if not diff <= rtol * scale:
            verdict = [
                f"model.pretrained={directory}: the loaded model's logits differ from transformers' own by {diff:.3g} "
                f"(largest {scale:.3g}) on a probe sequence: its initialization is wrong, training it would train "
                "another model; model.verify_pretrained=false skips this check"
            ]
        else:
            log.info("model.pretrained: the loaded model's logits are transformers' within %.3g", diff)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


class RowReader:
    """`read(key, rows)` as init_from's Source has it: a tensor of DIR's files, or only its
    rows [start, stop) of dim 0, read into a buffer of their size (no mapping of the file);
    `read_into` reads rows straight into a shard."""

    def __init__(self, directory: Path) -> None:
        self.what = f"model.pretrained={directory}"
        dtypes = {v: k for k, v in DTYPES.items()}
        self.where = {  # (headers only)
            key: (path, shape, dtypes[dtype], at) for key, (shape, path, dtype, at) in stored_shapes(directory).items()
        }
        self._fds: dict[Path, int] = {}

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        _, shape, dtype, _ = self.where[key]
        a, b = rows if rows is not None else (0, shape[0] if shape else 1)
        out = torch.empty(((b - a), *shape[1:]) if shape else (), dtype=dtype)
        self.pread(key, a, out)
        return out

    def read_into(self, key: str, rows: tuple[int, int], dest: torch.Tensor) -> bool:
        """Read the rows straight into `dest` (a rank's shard: nothing else is held) where it
        is host memory of the stored dtype, contiguous; False (nothing read) where not."""
        if dest.device.type != "cpu" or dest.dtype != self.where[key][2] or not dest.is_contiguous():
            return False
        self.pread(key, rows[0], dest)
        return True

    def pread(self, key: str, first_row: int, out: torch.Tensor) -> None:
        """Fill `out` with the stored bytes of `key` from row `first_row` on."""
        path, shape, dtype, at = self.where[key]
        buf, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
        at += first_row * math.prod(shape[1:]) * dtype.itemsize
        try:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            while done < len(buf):
                got = os.preadv(fd, [buf[done:]], at + done)
                if not got:
                    raise OSError(f"{path} ends before {key}'s rows (truncated since the check?)")
                done += got
        except OSError as e:
            raise CheckpointError(f"{self.what}: reading {key} from {path}: {e}") from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class LaidOut:
    """init_from's Source of a transformers model's tensors over a RowReader of its files,
    by the model's layout (models/hf_layout.py): the rows of a tensor the files split (a
    layer's experts) put together from the file tensors of those rows alone, each read
    straight into its place where it can be; any other tensor read as it is stored."""

    def __init__(self, reader: RowReader, layout: Layout, targets: dict[str, torch.Tensor]) -> None:
        self.reader = reader
        self.shapes = {k: tuple(t.shape) for k, t in targets.items()}
        held = reader.where  # (files_wanted's choice: the model's own name where the files have it alone)
        self.stored_as = {key: name for name, key in layout.items() if isinstance(key, str) and name in held}
        self.parts: dict[str, list[tuple[Part, str]]] = {}
        for name, part in layout.items():
            if isinstance(part, Part) and name in held:
                self.parts.setdefault(part.key, []).append((part, name))

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if key not in self.parts:
            return self.reader.read(self.stored_as.get(key, key), rows)
        shape = self.shapes[key]
        a, b = rows if rows is not None else (0, shape[0])
        out = torch.empty((b - a, *shape[1:]), dtype=self.reader.where[self.parts[key][0][1]][2])
        self._rows_into(key, a, b, out)
        return out

    def read_into(self, key: str, rows: tuple[int, int], dest: torch.Tensor) -> bool:
        if key not in self.parts:
            return self.reader.read_into(self.stored_as.get(key, key), rows, dest)
        if dest.device.type != "cpu" or dest.dtype != self.reader.where[self.parts[key][0][1]][2]:
            return False
        self._rows_into(key, *rows, dest)
        return True

    def _rows_into(self, key: str, a: int, b: int, out: torch.Tensor) -> None:
        """Rows [a, b) of `key` into `out`, piece by piece (a contiguous piece read in place)."""
        for part, name in self.parts[key]:
            if a <= part.row < b:
                view = out[part.row - a].narrow(part.dim, part.start, part.stop - part.start)
                if view.is_contiguous():
                    self.reader.pread(name, 0, view)
                else:
                    view.copy_(self.reader.read(name))
