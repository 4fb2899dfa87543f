"""A Hugging Face model directory out of a composerun Llama (`checkpoint.export=hf`,
`composerun-ckpt export CKPT --format hf OUT`), which `transformers`' `from_pretrained` loads
as it is.

The directory holds:

- `config.json`: models/hf.py's `hf_config` of the model; with `model.pretrained`, the
  source directory's config.json with its other keys (token ids, ...) kept; for a transformers
  model (`+model=hf`) the source directory's config.json as it is (its dtype the export's);
- the tensors under Hugging Face's names (`model.` prefix, `lm_head.weight`; a tied model
  has none, and transformers ties it; a mixture of experts' fused experts expert by expert, as
  save_pretrained writes them: models/hf_layout.py), in safetensors files with `format: pt` metadata:
  one `model.safetensors`, or, beyond `max_shard_size` bytes, Hugging Face's sharded layout
  (`model-00001-of-00003.safetensors`, ..., and `model.safetensors.index.json` naming each
  tensor's file and the total size), cut in the state dict's order as `save_pretrained` cuts;
- `generation_config.json` where the pretrained directory has one;
- the tokenizer's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...)
  from the run's tokenizer directory: `data.tokenizer`'s, else the pretrained directory's
  (one with vocab.json and merges.txt, or tokenizer.model, and no tokenizer.json too), else
  the one the token shards record (composerun.data.tokens.run_tokenizer).  A config.json that
  is not the source's as it is gets the tokenizer's bos/eos token ids where it has none.

In a run nothing is gathered: rank 0 creates every file with its header and each rank
writes the rows it holds into their place (export.write_in_place), as the safetensors
export does.  The command line writes from a DCP checkpoint a batch of tensors at a time.
Either way the directory is made as `OUT.tmp` and renamed to OUT once complete: a failed
export leaves nothing that looks like a model directory.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from composerun.checkpoint.export import RowPiece, agree, model_tensors, write_in_place
from composerun.checkpoint.folders import replace_dir
from composerun.checkpoint.safetensors_io import write_file
from composerun.config.schema import Config, Export
from composerun.errors import CheckpointError, ConfigError
from composerun.models.hf import LLAMA, hf_config, hf_name, our_name
from composerun.models.hf_causal import HF_TARGET, read_config_json, tied_keys
from composerun.models.hf_layout import Part, file_layout
from composerun.models.lora import is_adapter_key, merged_weights

MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default ("5GB")
INDEX = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
# What a Hugging Face tokenizer directory may hold (a tokenizer's own files, nothing else)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # (a directory with one holds a tokenizer)

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def check_exportable(model_target: str, option: str = "checkpoint.export=") -> None:
    """ConfigError unless the model has a Hugging Face equivalent (composerun's Llama), in the
    words of the option asked for (`checkpoint.export=`, or composerun-ckpt's `--format `)."""
    if model_target not in (LLAMA, HF_TARGET):
        raise ConfigError(
            f"{option}hf: model._target_={model_target} has no Hugging Face equivalent "
            f"(only {LLAMA} and +model=hf have: +model=llama3_debug, +model=llama3 ...); use {option}safetensors"
        )


def _names(cfg: Config) -> tuple[Any, Any]:
    """(composerun key -> Hugging Face name, and back): a transformers model's keys are its names."""
    same = lambda k: k  # noqa: E731
    return (hf_name, our_name) if cfg.model._target_ == LLAMA else (same, same)


def check_export(cfg: Config) -> None:
    """`checkpoint.export=hf`: the model has a Hugging Face equivalent (before any rank starts)."""
    if cfg.checkpoint.export == Export.hf:
        check_exportable(cfg.model._target_)
    if cfg.checkpoint.export == Export.peft:
        from composerun.checkpoint.peft_export import check_peft

        check_peft(cfg)


def shard_plan(specs: Specs, max_bytes: int) -> dict[str, list[str]]:
    """Each file's name and its keys, in the specs' order: a new file whenever the next tensor
    would take the current one past `max_bytes` (a tensor larger than that gets a file of its
    own); one file is `model.safetensors`."""
    groups: list[list[str]] = []
    held = 0
    for key, (dtype, shape) in specs.items():
        n = math.prod(shape) * dtype.itemsize
        if not groups or (held + n > max_bytes and groups[-1]):
            groups.append([])
            held = 0
        groups[-1].append(key)
        held += n
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def index_json(plan: dict[str, list[str]], specs: Specs) -> dict[str, Any]:
    total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())
    return {"metadata": {"total_size": total}, "weight_map": {k: name for name, keys in plan.items() for k in keys}}


def tokenizer_dir(cfg: Config) -> Path | None:
    """The directory whose tokenizer files the export copies: the run's tokenizer.json's
    (data.tokenizer's, else model.pretrained's, else the token shards' recorded one), or the
    pretrained directory's tokenizer without a tokenizer.json (vocab.json and merges.txt, a
    tokenizer.model); None where there is none (or it is no longer there)."""
    from composerun.data.tokens import run_tokenizer

    pretrained = Path(cfg.model.pretrained).expanduser() if cfg.model.pretrained else None
    if not cfg.data.tokenizer and pretrained is not None and any((pretrained / f).is_file() for f in VOCABULARY_FILES):
        return pretrained
    try:
        found = run_tokenizer(cfg)
    except ConfigError:  # (the command line: the run's data or tokenizer moved since)
        return None
    return found.parent if found is not None else None


def special_token_ids(tok: Path | None) -> dict[str, int]:
    """bos_token_id/eos_token_id of the tokenizer in `tok` (its tokenizer_config.json's tokens),
    for a config.json that has none (a model trained from scratch)."""
    if tok is None or not all((tok / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
        return {}
    from tokenizers import Tokenizer

    names = json.loads((tok / "tokenizer_config.json").read_text())
    vocab = Tokenizer.from_file(str(tok / "tokenizer.json"))
    out = {}
    for key in ("bos_token", "eos_token"):
        name = names.get(key)
        name = name.get("content") if isinstance(name, dict) else name
        token_id = vocab.token_to_id(name) if isinstance(name, str) else None
        if token_id is not None:
            out[f"{key}_id"] = token_id
    return out


def write_side_files(out: Path, cfg: Config, model: torch.nn.Module, dtype: str, index: dict | None) -> list[str]:
    """config.json, the index, generation_config.json and the tokenizer's files into `out`;
    what could not be found, as notes for the caller to print."""
    notes, source = [], None
    pretrained = Path(cfg.model.pretrained).expanduser() if cfg.model.pretrained else None
    if pretrained is not None:
        try:
            source = read_config_json(pretrained)
        except ConfigError as e:
            notes.append(f"config.json without the pretrained directory's other keys: {e}")
    as_it_is = cfg.model._target_ == HF_TARGET and source is not None
    if cfg.model._target_ == HF_TARGET:  # transformers' model: its directory's config.json, as it is
        config = dict(source or model.config.to_dict())
        config.update({k: dtype for k in ("torch_dtype",) if k in config})
    else:
        config = hf_config(model, dtype, source)
    # transformers 5 reads `dtype` before `torch_dtype` and loads in it ("auto"): a bfloat16 source's
    # key would cast the exported float32 weights
    config["dtype"] = dtype
    tok = tokenizer_dir(cfg)
    for key, value in {} if as_it_is else special_token_ids(tok).items():  # generate() stops at eos_token_id
        if config.get(key) is None:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if index is not None:
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if pretrained is not None and (pretrained / "generation_config.json").is_file():
        shutil.copyfile(pretrained / "generation_config.json", out / "generation_config.json")
    for name in TOKENIZER_FILES if tok is not None else ():
        if (tok / name).is_file():
            shutil.copyfile(tok / name, out / name)
    if tok is None and (cfg.data.tokenizer or str(cfg.data._target_).endswith("TokenData")):
        notes.append("no tokenizer copied: the run's tokenizer is no longer where its config says")
    return notes


def replaceable(out: Path) -> bool:
    """Whether `out` may be replaced by an export: absent, empty, or an earlier export (only the
    files an export writes), never a folder holding anything else."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    ours = {"config.json", "generation_config.json", "model.safetensors", INDEX, *TOKENIZER_FILES}
    shard = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
    return all(p.is_file() and (p.name in ours or shard.match(p.name)) for p in out.iterdir())


def _fresh(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # what an earlier failed export left
    tmp.mkdir(parents=True)


def _float_dtype(specs: Specs) -> str:
    floats = [d for d, _ in specs.values() if d.is_floating_point]
    return str(floats[0] if floats else torch.float32).removeprefix("torch.")


def export_hf(model: torch.nn.Module, cfg: Config, out: Path, max_shard_size: int | None = None) -> Path:
    """The (sharded) model as a Hugging Face directory at `out`, written by every rank (the
    module's docstring); every rank raises the same CheckpointError if any rank fails."""
    tied = tied_keys(model)  # (a tied lm_head.weight: not stored, as save_pretrained stores none)
    live = {**model_tensors(model), **merged_weights(model)}  # adapter=lora: each adapted weight with its adapter
    tensors = {_names(cfg)[0](k): t for k, t in live.items() if k not in tied and not is_adapter_key(k)}
    laid = file_layout(model)
    if laid is not None:  # the files' own tensors: an expert's projection a piece of a row
        tensors = {name: tensors[p] if isinstance(p, str) else RowPiece(tensors[p.key], p.row, p.dim, p.start, p.stop)
                   for name, p in laid.items()}  # fmt: skip
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    plan = shard_plan(specs, max_shard_size or MAX_SHARD_BYTES)
    tmp, what = out.with_name(out.name + ".tmp"), f"exporting the model to {out}"
    err = None
    try:
        if dist.get_rank() == 0:
            try:
                _fresh(tmp)
                index = index_json(plan, specs) if len(plan) > 1 else None
                for note in write_side_files(tmp, cfg, model, _float_dtype(specs), index):
                    print(f"composerun: export: {note}", flush=True)
            except (OSError, ConfigError) as e:
                err = str(e)
        agree(err, what)
        write_in_place({tmp / name: {k: tensors[k] for k in keys} for name, keys in plan.items()}, METADATA, what)
        if dist.get_rank() == 0:
            try:
                replace_dir(tmp, out)
            except OSError as e:
                err = str(e)
        agree(err, what)
    except CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _key(place: str | Part) -> str:
    return place.key if isinstance(place, Part) else place


def _piece_spec(specs: Specs, place: str | Part) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype, shape = specs[_key(place)]
    return (dtype, place.shape(shape) if isinstance(place, Part) else shape)


def export_checkpoint(cfg: Config, specs: Specs, load: Any, out: Path, max_shard_size: int | None = None) -> list[str]:
    """The command line's export: `specs` (the checkpoint's model keys, composerun's names,
    with dtype and shape), `load(keys)` their tensors a batch at a time, `cfg` the run's
    config from the checkpoint's manifest; notes for the user (what was not found)."""
    check_exportable(cfg.model._target_, option="--format ")
    if str(cfg.adapter.name) != "none":
        raise ConfigError(
            "--format hf: the checkpoint holds adapters only (adapter=lora), not the base to merge them into; "
            "use --format peft, or run with checkpoint.export=hf"
        )
    from composerun.models import build_model

    with torch.device("meta"):  # for config.json: its structure only
        model = build_model(cfg.model)
    hf_name, our_name = _names(cfg)
    tied = tied_keys(model)
    hf_specs = {hf_name(k): v for k, v in specs.items() if k not in tied}
    laid = file_layout(model) or {k: k for k in hf_specs}  # (a transformers model's file tensors)
    hf_specs = {name: _piece_spec(hf_specs, p) for name, p in laid.items()}
    plan = shard_plan(hf_specs, max_shard_size or MAX_SHARD_BYTES)
    tmp = out.with_name(out.name + ".tmp")
    try:
        _fresh(tmp)
        notes = write_side_files(
            tmp, cfg, model, _float_dtype(specs), index_json(plan, hf_specs) if len(plan) > 1 else None
        )
        for name, keys in plan.items():

            def fill(batch: list[str]) -> dict[str, torch.Tensor]:
                whole = {hf_name(k): t for k, t in load(sorted({our_name(_key(laid[k])) for k in batch})).items()}
                return {k: whole[_key(laid[k])] if isinstance(laid[k], str) else laid[k].of(whole[laid[k].key]).contiguous()
                        for k in batch}  # fmt: skip

            write_file(tmp / name, {k: hf_specs[k] for k in keys}, METADATA, fill)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return notes
