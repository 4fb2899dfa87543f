"""composerun-tokenize: local text, JSONL and Parquet files into token shards for `data=tokens`;
with --chat, JSONL conversations into shards with a loss mask on the assistant's answers.

    composerun-tokenize INPUT... --tokenizer TOK --out DIR [--text-key text] [--shard-tokens N] [--num-proc N]
    composerun-tokenize CHAT.jsonl... --chat --tokenizer TOK --out DIR [--chat-template FILE]
        [--messages-key messages] [--train-on assistant|all] [--max-tokens N [--too-long truncate|drop]]
        [--no-assistant skip|refuse] [--shard-tokens N]

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

With `--chat`, each JSONL line is a conversation (`{"messages": [{"role", "content"}]}`),
rendered with the tokenizer's chat template (or `--chat-template FILE`) and written with a loss
mask (the assistant's turns, or `--train-on all`) and each conversation's start beside each
shard; a conversation is never split across shards.  `--max-tokens N` truncates longer ones
(or drops them: `--too-long drop`); one with no assistant turn is skipped (or refused:
`--no-assistant refuse`); each is counted.  See composerun/data/chat.py.

Nothing is half-written: the shards go to a hidden folder beside DIR that is renamed to DIR
only when all of them are there, and removed if the run fails.  Bad input (no such file, an
unknown kind of file, no tokenizer, a missing text column; with `--chat`, a line that is not a
conversation, a role the template refuses, no chat template) is one line, naming the file and
line where there is one, and exit 2.
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
from composerun.data import chat
from composerun.errors import CONFIG_EXIT_CODE, ConfigError

PROG = "composerun-tokenize"
KINDS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl/.json or .parquet files (--chat: .jsonl/.json)"
    )
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json or a directory holding one")
    p.add_argument("--out", required=True, help="the folder to write the shards to (new, or empty)")
    p.add_argument("--text-key", help="the text column of JSONL/Parquet rows (default: text)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard at most")
    p.add_argument("--num-proc", type=int, default=None, help="encoding processes (default: one a core)")
    chat = p.add_argument_group("conversations (--chat)")
    chat.add_argument("--chat", action="store_true", help="JSONL conversations, with a loss mask and document starts")
    chat.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (default: the tokenizer's)")
    chat.add_argument("--messages-key", help="the messages list of each line (default: messages)")
    chat.add_argument("--train-on", choices=("assistant", "all"), help="the tokens trained on (default: assistant)")
    chat.add_argument("--max-tokens", type=int, metavar="N", help="a conversation's length limit (default: none)")
    chat.add_argument("--too-long", choices=("truncate", "drop"), help="beyond --max-tokens (default: truncate)")
    chat.add_argument(
        "--no-assistant", choices=("skip", "refuse"), help="a conversation with no assistant turn (default: skip)"
    )
    return p.parse_args(argv)


CHAT_DEFAULTS = {"messages_key": "messages", "train_on": "assistant", "too_long": "truncate", "no_assistant": "skip"}
CHAT_ONLY = ("chat_template", *CHAT_DEFAULTS, "max_tokens")


def check_options(args: argparse.Namespace) -> None:
    """The options that apply to the mode asked for (an option that would do nothing is refused)."""
    if not args.chat:
        given = [f"--{k.replace('_', '-')}" for k in CHAT_ONLY if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --chat")
    else:
        given = [f"--{k.replace('_', '-')}" for k in ("text_key", "num_proc") if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: not with --chat (see --messages-key; one encoding process)")
    args.text_key = args.text_key or "text"
    for k, v in CHAT_DEFAULTS.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    args.num_proc = args.num_proc or os.cpu_count() or 1
    if args.shard_tokens < 1 or args.num_proc < 1:
        raise ConfigError("--shard-tokens and --num-proc must be at least 1")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ConfigError(f"--max-tokens={args.max_tokens}: must be at least 2 (a target and a token before it)")


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

    check_options(args)
    groups = group_inputs(args.inputs)
    tok_file = tf.tokenizer_file(args.tokenizer, "--tokenizer")
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - any failure to parse it is the user's file
        raise ConfigError(f"--tokenizer={args.tokenizer}: not a Hugging Face tokenizer.json ({e})") from None
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out={out}: exists and is not an empty folder; name a new one")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    vocab = tok.get_vocab_size(with_added_tokens=True)
    meta = {"tokenizer": os.path.relpath(tok_file.resolve(), out.resolve()), "vocab_size": vocab}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    meta["eos_id"] = find_eos(tok_file, tok)
    try:
        if args.chat:
            shards, counts = chat.write_chat(tmp, tok, tok_file, args, meta)
            said = (
                f"{counts['written']} conversations, {shards.total} tokens ({shards.trained} trained) in "
                f"{shards.count} shard(s) of {shards.dtype.name} in {out}; {counts['truncated']} truncated, "
                f"{counts['dropped']} dropped (too long), {counts['skipped']} skipped (no assistant turn)"
            )
        else:
            writer = ShardWriter(tmp, tf.default_dtype(vocab), args.shard_tokens, meta)
            for kind, names in groups:
                _write_group(writer, kind, names, tok, args, tmp / "cache")
            writer.close()
            said = f"{writer.docs} documents, {writer.total} tokens in {writer.count} shard(s) of {writer.dtype.name} in {out}"
        shutil.rmtree(tmp / "cache", ignore_errors=True)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{PROG}: {said}", flush=True)


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
        tf.write_shard(shard, tokens, self.meta)
        self.count += 1
        self.total += len(tokens)
        self._parts, self._held = [], 0
