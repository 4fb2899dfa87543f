"""composerun-tokenize --chat: conversations rendered with a chat template into token shards
with a loss mask and document starts (what `data=sft` reads).

Each line of a JSONL file is one conversation, `{"messages": [{"role": ..., "content": ...}]}`.
It is rendered with the chat template as transformers' `apply_chat_template` renders it (a
sandboxed Jinja environment, `trim_blocks`/`lstrip_blocks`, `raise_exception`, the tokenizer's
special tokens such as `bos_token`, no generation prompt), and the text is encoded without
adding special tokens again: the template puts BOS where it wants it.  The template is
`--chat-template FILE`, else the tokenizer directory's `chat_template.jinja`, else its
tokenizer_config.json's `chat_template` (a string, or a list of named templates: "default").

The tokens trained on (`--train-on assistant`, the default) are each assistant turn's content
and its end-of-turn marker as the template renders them.  They are found by character offsets:
the conversation up to an assistant turn, rendered with the generation prompt, ends where the
turn's text starts, and rendered with the turn, ends where it stops; a token overlapping such a
span is trained on.  A template that renders an earlier turn differently once later ones follow
cannot be read this way and is refused.  `--train-on all` trains on every token.  The first
token of a conversation is never a target (nothing of its document comes before it).

Per shard `tokens_NNNNN.bin` three more things are written: `tokens_NNNNN.loss_mask` (uint8,
1 where the token is a target), `tokens_NNNNN.doc_starts` (int64, each conversation's first
offset, ascending from 0) and, in the sidecar, `chat`, `train_on`, `documents`, `loss_mask`
and `doc_starts`.  A conversation never spans two shards: a shard closes before one that does
not fit, and one longer than `--shard-tokens` gets a shard of its own.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import composerun.data.token_files as tf
from composerun.errors import ConfigError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHUNK = 256  # conversations encoded in one call (the tokenizers library encodes a batch in parallel)


def load_template(tok_file: Path, given: str | None, tokenizer_arg: str) -> tuple[str, str]:
    """(the template's text, what to call it in an error)."""
    if given is not None:
        try:
            return Path(given).read_text(), f"--chat-template={given}"
        except OSError as e:
            raise ConfigError(f"--chat-template={given}: cannot be read ({e.strerror})") from None
    folder = tok_file.parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), str(folder / "chat_template.jinja")
    template = _config(folder, "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # transformers' named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"--tokenizer={tokenizer_arg}: no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json); give one with --chat-template FILE"
        )
    return template, str(folder / "tokenizer_config.json")


def special_tokens(tok_file: Path) -> dict[str, str]:
    """The special tokens a template sees (`bos_token`...), from tokenizer_config.json and
    special_tokens_map.json beside the tokenizer, as transformers hands them to it."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config's win
        for key, value in _config(tok_file.parent, name).items():
            value = value.get("content") if isinstance(value, dict) else value
            if key in SPECIAL_TOKENS and isinstance(value, str):
                out[key] = value
    return out


def _config(folder: Path, name: str) -> dict[str, Any]:
    try:
        found = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def compile_template(text: str, where: str) -> Any:
    """The template compiled in an environment like transformers' (its globals and filters)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{where}: not a Jinja template ({e.message}, line {e.lineno})") from None


def read_conversations(path: Path, key: str) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(line number, messages) of each non-blank line, each checked: a list of {role, content}."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{n}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(
                    f"{path}:{n}: not JSON ({str(e).split(':')[0]}); give one conversation a line"
                ) from None
            messages = row.get(key) if isinstance(row, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ConfigError(f'{path}:{n}: no "{key}" list of messages (--messages-key={key})')
            for k, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ConfigError(f"{path}:{n}: message {k} is not a {{role, content}} object of two strings")
            yield n, messages


def render(
    template: Any, messages: list[dict[str, Any]], tokens: dict[str, str], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character span of each assistant turn in it."""
    import jinja2

    def text(upto: int, prompt: bool) -> str:
        try:  # the variables transformers gives a template (tools and documents: none)
            return template.render(
                messages=messages[:upto], tools=None, documents=None, add_generation_prompt=prompt, **tokens
            )
        except Exception as e:  # noqa: BLE001 - whatever the template does with the user's conversation
            why = (e.message or str(e)) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise ConfigError(f"{where}: the chat template refuses the conversation: {why}") from None

    full = text(len(messages), False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = text(i, True), text(i + 1, False)
        if not (full.startswith(end) and end.startswith(start)):
            raise ConfigError(
                f"{where}: the chat template renders the conversation up to assistant message {i} as other than "
                "the start of the whole one, so the assistant's tokens cannot be found; give a template that "
                "renders each turn the same whatever follows it (--chat-template FILE)"
            )
        spans.append((len(start), len(end)))
    return full, spans


def loss_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], train_on: str) -> np.ndarray:
    """1 for each token that is a target: one overlapping an assistant span (or any, with
    train_on=all), but never the first."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if train_on == "all":
        mask[:] = 1
    else:
        starts = np.array([o[0] for o in offsets], dtype=np.int64)
        ends = np.array([o[1] for o in offsets], dtype=np.int64)
        for a, b in spans:
            mask[(ends > a) & (starts < b)] = 1
    mask[:1] = 0
    return mask


class ChatShards:
    """Conversations appended whole to shards of at most `shard_tokens` (one longer than that
    gets a shard of its own), each shard with its loss mask, document starts and sidecar."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, meta: dict[str, Any]) -> None:
        self.folder, self.dtype, self.shard_tokens, self.meta = folder, dtype, shard_tokens, meta
        self.count = self.total = self.trained = 0
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._held = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if self._held and self._held + len(ids) > self.shard_tokens:
            self._flush()
        self._ids.append(ids.astype(self.dtype))
        self._masks.append(mask)
        self._held += len(ids)
        if self._held >= self.shard_tokens:
            self._flush()

    def close(self) -> None:
        if self._held:
            self._flush()

    def _flush(self) -> None:
        stem = f"tokens_{self.count:05d}"
        mask = np.concatenate(self._masks)
        starts = np.cumsum([0] + [len(i) for i in self._ids[:-1]], dtype=np.int64)
        mask.tofile(self.folder / f"{stem}.loss_mask")
        starts.tofile(self.folder / f"{stem}.doc_starts")
        names = {"loss_mask": f"{stem}.loss_mask", "doc_starts": f"{stem}.doc_starts"}
        tokens = np.concatenate(self._ids)
        tf.write_shard(self.folder / f"{stem}.bin", tokens, {**self.meta, "documents": len(self._ids), **names})
        self.count += 1
        self.total += len(tokens)
        self.trained += int(mask.sum())
        self._ids, self._masks, self._held = [], [], 0


def write_chat(folder: Path, tok: Any, tok_file: Path, args: Any, meta: dict[str, Any]) -> tuple[ChatShards, Counter]:
    """Every conversation of `args.inputs` into shards in `folder`; the writer and the counts
    (written, truncated, dropped, skipped)."""
    paths = [Path(p) for p in args.inputs]
    for p in paths:
        if p.suffix.lower() not in (".jsonl", ".json"):
            raise ConfigError(
                f"{p}: --chat reads JSONL conversations (.jsonl/.json, one a line), not {p.suffix or 'this'} files"
            )
    text, where = load_template(tok_file, args.chat_template, args.tokenizer)
    template = compile_template(text, where)
    tokens = special_tokens(tok_file)
    shards = ChatShards(
        folder,
        tf.default_dtype(meta["vocab_size"]),
        args.shard_tokens,
        {**meta, "chat": True, "train_on": args.train_on},
    )
    counts: Counter = Counter()
    for p in paths:
        todo: list[tuple[str, list[tuple[int, int]]]] = []
        for n, messages in read_conversations(p, args.messages_key):
            if not any(m["role"] == "assistant" for m in messages):
                if args.no_assistant == "refuse":
                    raise ConfigError(f"{p}:{n}: the conversation has no assistant turn (--no-assistant=refuse)")
                counts["skipped"] += 1
                continue
            todo.append(render(template, messages, tokens, f"{p}:{n}"))
            if len(todo) == CHUNK:
                _encode(todo, tok, shards, args, counts)
                todo = []
        _encode(todo, tok, shards, args, counts)
    shards.close()
    if not shards.count:
        raise ConfigError(
            f"the inputs hold no conversation to train on ({counts['skipped']} skipped: no assistant turn; "
            f"{counts['dropped']} dropped: longer than --max-tokens)"
        )
    return shards, counts


def _encode(
    todo: list[tuple[str, list[tuple[int, int]]]], tok: Any, shards: ChatShards, args: Any, counts: Counter
) -> None:
    """Rendered conversations to token ids and loss masks, cut or dropped at --max-tokens, written."""
    if not todo:
        return
    for (_, spans), enc in zip(todo, tok.encode_batch([t for t, _ in todo], add_special_tokens=False), strict=True):
        ids, mask = np.asarray(enc.ids, dtype=np.int64), loss_mask(enc.offsets, spans, args.train_on)
        if args.max_tokens is not None and len(ids) > args.max_tokens:
            if args.too_long == "drop" or not mask[: args.max_tokens].any():  # nothing left to train on
                counts["dropped"] += 1
                continue
            ids, mask = ids[: args.max_tokens], mask[: args.max_tokens]
            counts["truncated"] += 1
        elif not mask.any():  # a template that renders no assistant text: nothing to train on
            counts["skipped"] += 1
            continue
        shards.add(ids, mask)
        counts["written"] += 1
