"""composerun-tokenize: local text, JSONL and Parquet files into token shards for `data=tokens`.

    composerun-tokenize INPUT... --tokenizer TOK --out DIR [--text-key text] [--shard-tokens N] [--num-proc N]

TOK is a Hugging Face `tokenizer.json` or a directory holding one (a pretrained model's).
Documents: a `.txt` file's blank-line-separated paragraphs (a poem, a speech, a paragraph of
prose: the unit a model should see whole), a JSONL/Parquet file's rows (their `--text-key`
column).  Each document is encoded as the tokenizer's own post-processor has it (a Llama 3
tokenizer puts its BOS first) and followed by the tokenizer's EOS, where it has one, so
that a model learns where documents end.  The `datasets` library reads the files and
encodes them in `--num-proc` processes; the documents are then written in order, in `.bin`
shards of at most `--shard-tokens` tokens (a document may continue in the next shard),
uint16 when the vocabulary fits in it, else uint32, each with its sidecar
(composerun/data/token_files.py).

Nothing is half-written: the shards go to a hidden folder beside DIR that is renamed to DIR
only when all of them are there, and removed if the run fails.  Bad input (no such file, an
unknown kind of file, no tokenizer, a missing text column) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import composerun.data.token_files as tf
from composerun.console import quiet_on_closed_pipe
from composerun.errors import CONFIG_EXIT_CODE, ConfigError

PROG = "composerun-tokenize"
KINDS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl/.json or .parquet files")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json or a directory holding one")
    p.add_argument("--out", required=True, help="the folder to write the shards to (new, or empty)")
    p.add_argument("--text-key", default="text", help="the text column of JSONL/Parquet rows (default: text)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard at most")
    p.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="encoding processes")
    return p.parse_args(argv)


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tokenize(args)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    return 0


def group_inputs(inputs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The inputs by the `datasets` builder that reads them, in the order first named."""
    groups: dict[str, list[str]] = {}
    for name in inputs:
        p = Path(name)
        if not p.is_file():
            raise ConfigError(f"{name}: no such file")
        kind = KINDS.get(p.suffix.lower())
        if kind is None:
            raise ConfigError(f"{name}: unknown kind of file; give .txt, .jsonl/.json or .parquet files")
        groups.setdefault(kind, []).append(str(p))
    return list(groups.items())


def find_eos(tok_file: Path, tok: Any) -> int | None:
    """The EOS id: tokenizer_config.json's eos_token beside the tokenizer, else a usual name."""
    names = list(EOS_NAMES)
    try:
        eos = json.loads((tok_file.parent / "tokenizer_config.json").read_text()).get("eos_token")
        names.insert(0, eos["content"] if isinstance(eos, dict) else eos)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    return next((tok.token_to_id(n) for n in names if isinstance(n, str) and tok.token_to_id(n) is not None), None)


def _encode(batch: dict[str, list], tok: Any, key: str, eos: int | None) -> dict[str, list]:
    """One batch of documents to token ids (blank documents dropped), EOS after each."""
    texts = [t for t in batch[key] if isinstance(t, str) and t.strip()]
    tail = [] if eos is None else [eos]
    return {"ids": [e.ids + tail for e in tok.encode_batch(texts)]}


def tokenize(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer

    groups = group_inputs(args.inputs)
    tok_file = tf.tokenizer_file(args.tokenizer, "--tokenizer")
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - any failure to parse it is the user's file
        raise ConfigError(f"--tokenizer={args.tokenizer}: not a Hugging Face tokenizer.json ({e})") from None
    if args.shard_tokens < 1 or args.num_proc < 1:
        raise ConfigError("--shard-tokens and --num-proc must be at least 1")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out={out}: exists and is not an empty folder; name a new one")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    vocab = tok.get_vocab_size(with_added_tokens=True)
    meta = {"tokenizer": os.path.relpath(tok_file.resolve(), out.resolve()), "vocab_size": vocab}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        writer = ShardWriter(
            tmp, tf.default_dtype(vocab), args.shard_tokens, {**meta, "eos_id": find_eos(tok_file, tok)}
        )
        for kind, names in groups:
            _write_group(writer, kind, names, tok, args, tmp / "cache")
        writer.close()
        shutil.rmtree(tmp / "cache", ignore_errors=True)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{PROG}: {writer.docs} documents, {writer.total} tokens in {writer.count} shard(s) of "
        f"{writer.dtype.name} in {out}",
        flush=True,
    )


def _write_group(
    writer: ShardWriter, kind: str, names: list[str], tok: Any, args: argparse.Namespace, cache: Path
) -> None:
    """Read the files of one kind with `datasets`, encode them in parallel, write them in order."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask the hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    from datasets import load_dataset
    from tqdm import tqdm

    options = {"sample_by": "paragraph"} if kind == "text" else {}
    try:
        ds = load_dataset(kind, data_files=names, split="train", cache_dir=str(cache), **options)
    except Exception as e:  # noqa: BLE001 - datasets' own errors for a malformed file are many kinds
        raise ConfigError(f"{', '.join(names)}: cannot be read as {kind} ({str(e).splitlines()[0]})") from None
    key = "text" if kind == "text" else args.text_key
    if key not in ds.column_names:
        raise ConfigError(
            f"--text-key={key}: {', '.join(names)} has no such column (columns: {', '.join(ds.column_names)})"
        )
    procs = max(1, min(args.num_proc, len(ds) // 64))  # a process per few documents only costs start-up
    encoded = ds.map(
        partial(_encode, tok=tok, key=key, eos=writer.meta["eos_id"]),
        batched=True,
        num_proc=procs if procs > 1 else None,
        remove_columns=ds.column_names,
        desc=f"tokenizing {kind}",
    )
    with tqdm(total=len(encoded), unit="doc", desc="writing shards", file=sys.stderr) as bar:
        for batch in encoded.iter(batch_size=1024):
            for ids in batch["ids"]:
                writer.add(np.asarray(ids, dtype=writer.dtype))
            bar.update(len(batch["ids"]))


class ShardWriter:
    """Token ids appended in order to `tokens_NNNNN.bin` shards of at most `shard_tokens`,
    each closed with its sidecar."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, meta: dict[str, Any]) -> None:
        self.folder, self.dtype, self.shard_tokens, self.meta = folder, dtype, shard_tokens, meta
        self.count = self.total = self.docs = 0
        self._parts: list[np.ndarray] = []
        self._held = 0

    def add(self, ids: np.ndarray) -> None:
        self.docs += 1
        while len(ids):
            take = ids[: self.shard_tokens - self._held]
            self._parts.append(take)
            self._held += len(take)
            ids = ids[len(take) :]
            if self._held == self.shard_tokens:
                self._flush()

    def close(self) -> None:
        if self._held:
            self._flush()
        if not self.count:
            raise ConfigError("the inputs hold no text to tokenize")

    def _flush(self) -> None:
        tokens = np.concatenate(self._parts)
        shard = self.folder / f"tokens_{self.count:05d}.bin"
        tokens.tofile(shard)
        side = {"tokens": len(tokens), "max_id": int(tokens.max()), "dtype": self.dtype.name, **self.meta}
        tf.sidecar_of(shard).write_text(json.dumps(side, indent=1) + "\n")
        self.count += 1
        self.total += len(tokens)
        self._parts, self._held = [], 0
