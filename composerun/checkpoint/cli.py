"""`composerun-ckpt`: look inside a composerun checkpoint, or export its model, from the shell.

    composerun-ckpt inspect PATH [--json]     what a checkpoint holds and whether it is intact
    composerun-ckpt export PATH FILE          its `model` entry as one safetensors file
    composerun-ckpt export PATH --format hf DIR   a Llama run's model as a Hugging Face directory
                                  (--format peft DIR: an adapter=lora run's adapters as a PEFT directory)

PATH is a checkpoint folder (`.../checkpoints/step-NNNNNNNN`), a run's `checkpoints/`
folder or a run directory; the last two mean the newest complete checkpoint there.

No Hydra, no model and no process group: everything comes from the checkpoint's files
(`--format hf` builds the model on the meta device, for its config.json).
The manifest's checksums are checked before any tensor is read, DCP's pickled `.metadata`
is read through composerun's allow-list unpickler (SafeReader), and the model's tensors
are loaded by DCP in its single-process mode into plain CPU tensors shaped from that
metadata, a batch at a time, each written into its place in FILE (safetensors_io.py): the
process holds a batch (512 MiB), never the whole model.  torch is imported only once a
checkpoint has been found, so that `--help` and a wrong path answer at once.

Exit codes: 0 ok; 1 a damaged or unusable checkpoint (inspect prints what it found first);
2 a usage mistake (no such path, no checkpoint there, FILE not .safetensors).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from composerun.config.schema import byte_size as schema_byte_size
from composerun.console import quiet_on_closed_pipe
from composerun.errors import CONFIG_EXIT_CODE
from composerun.rundir import RunDir

PROG = "composerun-ckpt"
# Mirrors composerun.checkpoint (not imported here: it imports torch)
MANIFEST, METADATA = "manifest.json", ".metadata"
MANIFEST_FIELDS = ("step", "model", "mesh", "world_size", "policy", "torch_version", "config_hash")
TOP_LEVEL_ORDER = ("model", "optim", "train", "rng")


class UsageError(Exception):
    """The user's mistake: one line, exit 2."""


class DamagedError(Exception):
    """The checkpoint cannot be trusted or read: one line, exit 1."""


# --- finding the checkpoint ----------------------------------------------------------------


def resolve(path_arg: str) -> Path:
    """The checkpoint folder that PATH names (itself, or the newest complete one under it)."""
    path = Path(path_arg)
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory; give a checkpoint folder, a checkpoints/ folder or a run directory")
    if (path / MANIFEST).is_file() or (path / METADATA).is_file():
        return path  # a checkpoint folder (complete or not: inspect says which)
    checkpoints = RunDir(path).checkpoints
    root = checkpoints if checkpoints.is_dir() else path
    # cheap first: a folder with no `latest` and no step-* folder holds no checkpoint (no torch import)
    if (root / "latest").is_file() or any(root.glob("step-*")):
        from composerun.checkpoint.folders import find_latest

        found = find_latest(root)
        if found is not None:
            return found
    raise UsageError(
        f"{path}: no complete checkpoint here; give a checkpoint folder (checkpoints/step-N), "
        "a checkpoints/ folder or a run directory"
    )


# --- inspect -------------------------------------------------------------------------------


def _read_metadata(ckpt: Path) -> Any:
    from composerun.checkpoint.reader import SafeReader
    from composerun.errors import CheckpointError

    try:
        return SafeReader(str(ckpt)).read_metadata()
    except CheckpointError as e:
        raise DamagedError(str(e)) from None
    except OSError as e:
        raise DamagedError(f"{ckpt / METADATA}: {e.strerror or e}; the checkpoint is incomplete") from None


def entries(metadata: Any) -> list[dict[str, Any]]:
    """One row per stored key: key, shape (None for a bytes object), dtype, bytes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from composerun._torch_compat import item_locations

    stored: dict[str, int] = {}  # bytes objects: their serialized length in the files
    for index, info in item_locations(metadata).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    rows = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            numel = 1
            for n in md.size:
                numel *= int(n)
            rows.append(
                {
                    "key": key,
                    "shape": [int(n) for n in md.size],
                    "dtype": str(dtype).removeprefix("torch."),
                    "bytes": numel * dtype.itemsize,
                }
            )
        else:  # BytesStorageMetadata: a pickled object (optimizer hyperparameters and the like);
            # its bytes are what DCP wrote for it (torch.save framing included)
            rows.append({"key": key, "shape": None, "dtype": "bytes", "bytes": stored.get(key, 0)})
    # grouped by top-level entry (model, optim, train, rng), stored order within each
    return sorted(rows, key=lambda r: _group_rank(r["key"].split(".", 1)[0]))


def _group_rank(name: str) -> int:
    return TOP_LEVEL_ORDER.index(name) if name in TOP_LEVEL_ORDER else len(TOP_LEVEL_ORDER)


def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        t = out.setdefault(r["key"].split(".", 1)[0], {"entries": 0, "bytes": 0})
        t["entries"] += 1
        t["bytes"] += r["bytes"]
    return dict(sorted(out.items(), key=lambda kv: (_group_rank(kv[0]), kv[0])))


def inspect(ckpt: Path) -> dict[str, Any]:
    """What `inspect` reports, as one dict; `ok` says whether the checkpoint is intact."""
    from composerun.checkpoint.manifest import check_integrity, read_manifest
    from composerun.errors import CheckpointError

    report: dict[str, Any] = {"checkpoint": str(ckpt)}
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError:
        manifest = {}
    if not isinstance(manifest, dict):
        manifest = {}
    report.update({k: manifest.get(k) for k in MANIFEST_FIELDS})
    problems = []
    try:
        check_integrity(ckpt)
    except (CheckpointError, KeyError, TypeError, AttributeError, OSError) as e:
        problems.append(str(e) if isinstance(e, CheckpointError) else f"{ckpt / MANIFEST}: malformed ({e!r})")
    rows: list[dict[str, Any]] = []
    try:
        rows = entries(_read_metadata(ckpt))
    except DamagedError as e:
        if not problems:
            problems.append(str(e))
    report["integrity"] = problems[0] if problems else "ok"
    report["ok"] = not problems
    report["entries"] = rows
    report["totals"] = totals(rows)
    return report


def _shape(shape: list[int] | None) -> str:
    if shape is None:
        return "-"
    return "x".join(map(str, shape)) if shape else "scalar"


def print_report(report: dict[str, Any]) -> None:
    print(f"{'checkpoint':<13} {report['checkpoint']}")
    for k in MANIFEST_FIELDS:
        v = report[k]
        print(f"{k:<13} {'(not in the manifest)' if v is None else v}")
    print(f"{'integrity':<13} {report['integrity']}")
    rows = report["entries"]
    if not rows:
        return
    print()
    head = ("key", "shape", "dtype", "bytes")
    table = [head] + [(r["key"], _shape(r["shape"]), r["dtype"], str(r["bytes"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}")
    print()
    for name, t in report["totals"].items():
        print(f"total {name:<8} {t['entries']:>5} entries  {t['bytes']:>12} bytes")


def cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect(resolve(args.path))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


# --- export --------------------------------------------------------------------------------


def model_specs(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's `model` tensors, each key (the model's own, without `model.`) with its
    dtype and shape, from its metadata alone (no model, no process group)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    specs: dict[str, Any] = {}
    skipped = []
    for key, meta in _read_metadata(ckpt).state_dict_metadata.items():
        if not key.startswith("model."):
            continue
        if isinstance(meta, TensorStorageMetadata):
            specs[key[len("model.") :]] = (meta.properties.dtype, tuple(meta.size))
        else:
            skipped.append(key)
    if not specs:
        raise DamagedError(f"{ckpt}: no `model` tensors in the checkpoint")
    if skipped:
        print(f"{PROG}: note: not tensors, left out: {', '.join(skipped)}", file=sys.stderr)
    return specs


def load_model_tensors(ckpt: Path, specs: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """These keys of the checkpoint's `model` entry as plain CPU tensors, loaded by DCP in one process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from composerun.checkpoint.reader import SafeReader

    sd = {k: torch.empty(specs[k][1], dtype=specs[k][0]) for k in keys}
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is
            # to load in a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": sd}, storage_reader=SafeReader(str(ckpt)))
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        text = " ".join(str(e).split())[:300]
        raise DamagedError(f"loading {ckpt}: {type(e).__name__}: {text}") from None
    return sd


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.file)
    if out.suffix != ".safetensors" and args.format == "safetensors":
        raise UsageError(f"{out}: FILE must end in .safetensors (or give --format hf and a directory)")
    if args.format != "safetensors":
        from composerun.checkpoint import hf_export, peft_export

        if out.exists() and not out.is_dir():
            raise UsageError(f"{out}: --format {args.format} writes a directory, and {out} is a file")
        if not (hf_export if args.format == "hf" else peft_export).replaceable(out):
            raise UsageError(f"{out}: holds files that are not {'a Hugging Face' if args.format == 'hf' else 'a PEFT'} export; give a new or empty directory")  # fmt: skip
    ckpt = resolve(args.path)
    from composerun.checkpoint.manifest import check_integrity
    from composerun.errors import CheckpointError

    try:
        manifest = check_integrity(ckpt)
    except CheckpointError as e:
        raise DamagedError(f"refusing to export: {e}") from None
    except (KeyError, TypeError, AttributeError, OSError) as e:
        raise DamagedError(f"refusing to export: {ckpt / MANIFEST}: malformed ({e!r})") from None
    specs = model_specs(ckpt)
    if args.format != "safetensors":
        return _export_dir(ckpt, manifest, specs, out, args.max_shard_size, args.format)

    from composerun.checkpoint.safetensors_io import write_file

    meta = {"step": str(manifest.get("step")), "model": str(manifest.get("model")), "checkpoint": str(ckpt)}
    blocker = next((d for d in out.absolute().parents if d.exists() and not d.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"{out}: cannot write: {blocker} is a file, not a directory")
    try:
        # a batch of tensors at a time, written into place: memory for a batch, not the model
        write_file(out, specs, {**meta, "format": "pt"}, lambda keys: load_model_tensors(ckpt, specs, keys))
    except OSError as e:
        raise UsageError(f"{out}: cannot write: {e.strerror or e}") from None
    nbytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs.values())
    print(f"{out}: {len(specs)} tensors, {nbytes} bytes (model of {ckpt}, step {manifest.get('step')})")
    return 0


def _export_dir(ckpt: Path, manifest: dict[str, Any], specs: dict[str, Any], out: Path, max_shard: int, fmt: str) -> int:  # fmt: skip
    """`--format hf`: a Hugging Face model directory (hf_export.py), `peft` the adapters' (peft_export.py)."""
    from composerun.checkpoint import hf_export, peft_export
    from composerun.config.typed import to_typed
    from composerun.errors import CheckpointError, ConfigError

    if not isinstance(manifest.get("config"), dict):
        raise UsageError(f"{ckpt}: its manifest has no config (an older composerun's checkpoint): cannot export")
    blocker = next((d for d in out.absolute().parents if d.exists() and not d.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"{out}: cannot write: {blocker} is a file, not a directory")
    try:
        cfg = to_typed(manifest["config"])
        export = (hf_export if fmt == "hf" else peft_export).export_checkpoint
        notes = export(cfg, specs, lambda keys: load_model_tensors(ckpt, specs, keys), out, max_shard)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except CheckpointError as e:
        raise DamagedError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{out}: cannot write: {e.strerror or e}") from None
    for note in notes:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    files = sorted(p.name for p in out.iterdir())
    print(f"{out}: {'Hugging Face model' if fmt == 'hf' else 'PEFT adapters'} of {ckpt} (step {manifest.get('step')}): {', '.join(files)}")  # fmt: skip
    return 0


def byte_size(text: str) -> int:
    """`--max-shard-size`: bytes, or with a unit as Hugging Face writes it (5GB, 500MB, 2GiB)."""
    try:
        return schema_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- the command line ----------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect a composerun DCP checkpoint, or export its model as safetensors. "
        "PATH is a checkpoint folder (checkpoints/step-N), a run's checkpoints/ folder or a run "
        "directory (the newest complete checkpoint there). No process group is started.",
        epilog="exit codes: 0 ok, 1 damaged checkpoint, 2 usage error (bad path, no checkpoint, bad FILE)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{inspect,export}")
    pi = sub.add_parser(
        "inspect",
        help="print a checkpoint's manifest, integrity and stored entries",
        description="Print the checkpoint's path, its manifest (step, model, mesh, world size, policy, "
        "torch version, config hash), whether every file matches the manifest's size and checksum, and every "
        "stored entry (key, shape, dtype, bytes) with totals per top-level entry (model, optim, "
        "train, rng). Exits 1 if the checkpoint is damaged.",
    )
    pi.add_argument("path", metavar="PATH", help="checkpoint folder, checkpoints/ folder or run directory")
    pi.add_argument("--json", action="store_true", help="print the same as one JSON object")
    pi.set_defaults(func=cmd_inspect)
    pe = sub.add_parser(
        "export",
        help="write the checkpoint's model as one safetensors file",
        description="Verify the checkpoint's checksums, load its `model` entry into plain CPU tensors a "
        "batch at a time (no model is built, no process group is started) and write FILE as safetensors, keyed like "
        "the unsharded model's state_dict(). Refuses a damaged checkpoint (exit 1).",
    )
    pe.add_argument("path", metavar="PATH", help="checkpoint folder, checkpoints/ folder or run directory")
    pe.add_argument("file", metavar="FILE", help="the .safetensors file to write (--format hf: the directory)")
    pe.add_argument(
        "--format",
        choices=("safetensors", "hf", "peft"),
        default="safetensors",
        help="safetensors: one file, the model's own keys; hf: a Hugging Face model directory (config.json, "
        "safetensors under Hugging Face's names, tokenizer files) that transformers loads; a Llama run's checkpoint; "
        "peft: an adapter=lora run's adapters (adapter_config.json, adapter_model.safetensors) that PEFT loads",
    )
    pe.add_argument(
        "--max-shard-size",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="--format hf: the largest safetensors file (bytes, or 5GB, 500MB...); a larger model is split into "
        "model-0000K-of-0000N.safetensors with model.safetensors.index.json (default: 5GB, as save_pretrained)",
    )
    pe.set_defaults(func=cmd_export)
    return p


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except UsageError as e:
        _fail(str(e), CONFIG_EXIT_CODE)
    except DamagedError as e:
        _fail(str(e), 1)
    sys.exit(code)


def _fail(line: str, code: int) -> None:
    print(f"{PROG}: error: {line}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
