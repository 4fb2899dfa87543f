"""composerun-tokenize --chat (composerun/data/chat.py): conversations into token shards with a
loss mask and document starts.

Pure tier (the command's function, in this process).  The reference is transformers: each
conversation's tokens are `AutoTokenizer.apply_chat_template(messages, tokenize=True)`'s, and
the trained tokens decode (transformers' decode) to exactly the assistant turns' contents and
their end-of-turn markers.  The tokenizer is the shipped one with a Llama-3-like template (and
its three header tokens) in its tokenizer_config.json; a second, ChatML-like template of plain
text markers comes from --chat-template.  Every bad input is one line naming file:line, exit 2,
nothing written.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from composerun.data import token_files as tf
from composerun.data.tokenize import main

LLAMA_LIKE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ('system', 'user', 'assistant') %}\n"
    "        {{- raise_exception('Conversation roles must be system, user or assistant, not ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
LLAMA_EOT = "<|eot_id|>"
# plain-text markers (not special tokens): a token may straddle a turn's content and its marker
# (and transformers' {% generation %} marks, which render their text)
CHATML_LIKE = (
    "{% for message in messages %}{% if message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message.content + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_EOT = "<|im_end|>\n"
WORDS = "the fox river naïve stone 42 green, quick; it's ask why? café light 7 over and then".split()


def make_tokenizer(folder: Path, template: object) -> Path:
    """The shipped tokenizer with Llama 3's three header tokens added, and `template` (None: no
    chat template) as tokenizer_config.json's chat_template."""
    from tokenizers import Tokenizer

    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(tf.shipped_tokenizer() / "tokenizer.json"))
    tok.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", LLAMA_EOT])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((tf.shipped_tokenizer() / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(tf.shipped_tokenizer() / "special_tokens_map.json", folder)
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("chat") / "tok", LLAMA_LIKE)


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + rng.choice(".!?")


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Uneven conversations: 1 to 3 assistant turns, a system message in some, one long one,
    one with no assistant turn (the fifth)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        msgs = [{"role": "system", "content": sentence(rng, 3, 8)}] if k % 3 == 0 else []
        for _ in range(1 + k % 3):
            msgs += [{"role": "user", "content": sentence(rng, 2, 12)}]
            msgs += [{"role": "assistant", "content": sentence(rng, 1, 60 if k == 2 else 20)}]
        out.append([{"role": "user", "content": "Nothing to answer."}] if k == 4 else msgs)
    return out


def write_jsonl(path: Path, convs: list[list[dict[str, str]]], key: str = "messages") -> Path:
    path.write_text("".join(json.dumps({key: c, "id": i}) + "\n" for i, c in enumerate(convs)))
    return path


def tokenize(
    cwd: Path, *args: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def read_shards(folder: Path) -> list[tuple[np.ndarray, np.ndarray, dict]]:
    """(ids, mask) of every document, in order, and each shard's sidecar checked."""
    docs = []
    for shard in sorted(folder.glob("*.bin")):
        meta = json.loads(shard.with_suffix(".json").read_text())
        ids = np.fromfile(shard, dtype=meta["dtype"])
        mask = np.fromfile(folder / meta["loss_mask"], dtype=np.uint8)
        starts = np.fromfile(folder / meta["doc_starts"], dtype=np.int64)
        assert meta["chat"] is True and meta["tokens"] == len(ids) == len(mask) and meta["documents"] == len(starts)
        assert meta["loss_mask"] == f"{shard.stem}.loss_mask" and meta["doc_starts"] == f"{shard.stem}.doc_starts"
        assert starts[0] == 0 and (np.diff(starts) > 0).all() and meta["max_id"] == ids.max()
        for a, b in itertools.pairwise([*starts.tolist(), len(ids)]):
            docs.append((ids[a:b], mask[a:b], meta))
    return docs


def trained_texts(hf_tok, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Each run of trained tokens, decoded by transformers."""
    runs, pos = [], 0
    for on, group in itertools.groupby(mask.tolist()):
        n = len(list(group))
        if on:
            runs.append(hf_tok.decode(ids[pos : pos + n].tolist(), skip_special_tokens=False))
        pos += n
    return runs


def reference_ids(hf_tok, messages, **kwargs) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_shards_are_transformers_chat_template_with_the_assistant_turns_trained(
    tok_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The tokenizer's own template; shards of 150 tokens at most, so that conversations end
    shards early and the long one has a shard of its own."""
    from transformers import AutoTokenizer

    convs = conversations(9)
    write_jsonl(tmp_path / "chat.jsonl", convs)
    code, out, err = tokenize(tmp_path, "chat.jsonl", "--chat", "--tokenizer", str(tok_dir), "--out", "tok",
                              "--shard-tokens", "150", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0, err
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    kept = [c for c in convs if any(m["role"] == "assistant" for m in c)]
    docs = read_shards(tmp_path / "tok")
    assert len(docs) == len(kept) == 8
    refs = [reference_ids(hf, c) for c in kept]
    assert any(len(r) > 150 for r in refs) and len({len(r) for r in refs}) == len(refs)  # uneven, one over a shard
    for (ids, mask, meta), ref, conv in zip(docs, refs, kept, strict=True):
        assert ids.tolist() == ref and meta["train_on"] == "assistant"
        assert trained_texts(hf, ids, mask) == [m["content"] + LLAMA_EOT for m in conv if m["role"] == "assistant"]
    shards = sorted((tmp_path / "tok").glob("*.bin"))
    assert len(shards) > 2
    for shard in shards:  # full shards, never a conversation cut: a long one alone
        meta = json.loads(shard.with_suffix(".json").read_text())
        assert meta["tokens"] <= 150 or meta["documents"] == 1
    total, trained = sum(len(r) for r in refs), sum(int(m.sum()) for _, m, _ in docs)
    assert out.strip() == (
        f"composerun-tokenize: 8 conversations, {total} tokens ({trained} trained) in {len(shards)} shard(s) of "
        "uint16 in tok; 0 truncated, 0 dropped (too long), 1 skipped (no assistant turn)"
    )


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_a_template_file_and_train_on_all(tok_dir: Path, tmp_path: Path, capsys, monkeypatch, train_on) -> None:
    """--chat-template wins over the tokenizer's; its plain-text markers still give exactly the
    assistant turns; --train-on all trains on every token but each conversation's first."""
    from transformers import AutoTokenizer

    convs = [c for c in conversations(7, seed=1) if any(m["role"] == "assistant" for m in c)]
    write_jsonl(tmp_path / "chat.jsonl", convs, key="turns")
    (tmp_path / "chatml.jinja").write_text(CHATML_LIKE)
    code, _, err = tokenize(tmp_path, "chat.jsonl", "--chat", "--tokenizer", str(tok_dir), "--out", "tok",
                            "--chat-template", "chatml.jinja", "--messages-key", "turns", "--train-on", train_on,
                            capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0, err
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    docs = read_shards(tmp_path / "tok")
    assert len(docs) == len(convs) == 6
    for (ids, mask, meta), conv in zip(docs, convs, strict=True):
        assert ids.tolist() == reference_ids(hf, conv, chat_template=CHATML_LIKE) != reference_ids(hf, conv)
        assert meta["train_on"] == train_on
        if train_on == "all":
            assert mask.tolist() == [0] + [1] * (len(ids) - 1)
        else:
            assert trained_texts(hf, ids, mask) == [m["content"] + CHATML_EOT for m in conv if m["role"] == "assistant"]


@pytest.mark.parametrize("too_long", ["truncate", "drop"])
def test_too_long_conversations_are_cut_or_dropped_and_counted(
    tok_dir: Path, tmp_path: Path, capsys, monkeypatch, too_long
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    convs = [c for c in conversations(9, seed=2) if any(m["role"] == "assistant" for m in c)]
    refs = [reference_ids(hf, c) for c in convs]
    limit = sorted(len(r) for r in refs)[len(refs) // 2]  # half are longer
    # a conversation whose only assistant turn starts past the limit: nothing left to train on
    late = [{"role": "user", "content": sentence(random.Random(3), 80, 90)}, {"role": "assistant", "content": "Yes."}]
    assert len(reference_ids(hf, late[:1])) > limit
    write_jsonl(tmp_path / "chat.jsonl", [*convs, late])
    code, out, err = tokenize(tmp_path, "chat.jsonl", "--chat", "--tokenizer", str(tok_dir), "--out", "tok",
                              "--max-tokens", str(limit), "--too-long", too_long, capsys=capsys,
                              monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0, err
    docs = read_shards(tmp_path / "tok")
    longer = sum(len(r) > limit for r in refs)
    assert 0 < longer < len(refs)
    if too_long == "truncate":
        assert [d[0].tolist() for d in docs] == [r[:limit] for r in refs]
        counts = f"{longer} truncated, 1 dropped (too long)"
    else:
        assert [d[0].tolist() for d in docs] == [r for r in refs if len(r) <= limit]
        counts = f"0 truncated, {longer + 1} dropped (too long)"
    assert f"{len(docs)} conversations" in out and f"; {counts}, 0 skipped" in out, out


def test_named_templates_take_the_default(tmp_path: Path, capsys, monkeypatch) -> None:
    from transformers import AutoTokenizer

    named = [{"name": "tool_use", "template": CHATML_LIKE}, {"name": "default", "template": LLAMA_LIKE}]
    tok_dir = make_tokenizer(tmp_path / "named", named)
    conv = conversations(2, seed=4)[1]
    write_jsonl(tmp_path / "chat.jsonl", [conv])
    code, _, err = tokenize(tmp_path, "chat.jsonl", "--chat", "--tokenizer", str(tok_dir), "--out", "tok",
                            capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0, err
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    [(ids, _, _)] = read_shards(tmp_path / "tok")
    assert ids.tolist() == reference_ids(hf, conv, chat_template=LLAMA_LIKE)


def test_bad_inputs_are_one_line_naming_file_and_line_and_leave_nothing(
    tok_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    good = json.dumps({"messages": conversations(1)[0]})
    no_template = make_tokenizer(tmp_path / "plain", None)
    e = "composerun-tokenize: error: "
    cases = {
        "not_json": ([good, "{'messages': oops}"], (), f"{e}chat.jsonl:2: not JSON (Expecting property name enclosed in double quotes); give one conversation a line"),
        "no_messages": ([good, "", json.dumps({"text": "hi"})], (), f'{e}chat.jsonl:3: no "messages" list of messages (--messages-key=messages)'),
        "not_a_message": ([json.dumps({"messages": [{"role": "user", "content": ["a"]}]})], (),
                          f"{e}chat.jsonl:1: message 0 is not a {{role, content}} object of two strings"),
        "unknown_role": ([good, good, json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]})], (),
                         f"{e}chat.jsonl:3: the chat template refuses the conversation: Conversation roles must be system, "
                         "user or assistant, not tool"),
        "no_template": ([good], ("--tokenizer", str(no_template)), f"{e}--tokenizer={no_template}: no chat template (no "
                        "chat_template.jinja, no chat_template in tokenizer_config.json); give one with --chat-template FILE"),
        "refuse": ([good, json.dumps({"messages": [{"role": "user", "content": "x"}]})], ("--no-assistant", "refuse"),
                   f"{e}chat.jsonl:2: the conversation has no assistant turn (--no-assistant=refuse)"),
        "bad_template": ([good], ("--chat-template", "t.jinja"), f"{e}--chat-template=t.jinja: not a Jinja template "
                         "(unexpected end of template, expected 'end of print statement'., line 1)"),
        "not_utf8": ([good, good.replace('"content": "', '"content": "\udcff', 1)], (), f"{e}chat.jsonl:2: not UTF-8 text"),
        "nothing_left": ([json.dumps({"messages": [{"role": "user", "content": "x"}]})] * 2 + [good], ("--max-tokens", "5"),
                         f"{e}the inputs hold no conversation to train on (2 skipped: no assistant turn; 1 dropped: longer "
                         "than --max-tokens)"),
        "last_turn_apart": ([json.dumps({"messages": [{"role": r, "content": "x"} for r in ("user", "assistant") * 2]})],
                            ("--chat-template", "last.jinja"), f"{e}chat.jsonl:1: the chat template renders the "
                            "conversation up to assistant message 1 as other than the start of the whole one, so the "
                            "assistant's tokens cannot be found; give a template that renders each turn the same "
                            "whatever follows it (--chat-template FILE)"),
    }  # fmt: skip
    for name, (lines, extra, line) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "chat.jsonl").write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
        (d / "t.jinja").write_text("{{ bos_token ")
        # a template that renders the last turn apart
        (d / "last.jinja").write_text(
            "{% for m in messages %}{{ m.role }}: {% if loop.last %}(last) {% endif %}{{ m.content }}\n{% endfor %}"
        )
        args = ["chat.jsonl", "--chat", "--tokenizer", str(tok_dir), *extra, "--out", "tok"]
        code, out, err = tokenize(d, *args, capsys=capsys, monkeypatch=monkeypatch)
        assert (code, err.strip(), out) == (2, line, ""), name
        assert sorted(p.name for p in d.iterdir()) == ["chat.jsonl", "last.jinja", "t.jinja"], (
            f"{name}: nothing written"
        )
    # other modes' inputs and options
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "a.jsonl").write_text(good + "\n")
    for args, line in [
        (("a.txt", "--chat"), f"{e}a.txt: --chat reads JSONL conversations (.jsonl/.json, one a line), not .txt files"),
        (("a.txt", "--train-on", "all", "--max-tokens", "9"), f"{e}--train-on, --max-tokens: only with --chat"),
        (("a.jsonl", "--chat", "--num-proc", "2", "--text-key", "t"), f"{e}--text-key, --num-proc: not with --chat (see "
         "--messages-key; one encoding process)"),
    ]:  # fmt: skip
        code, _, err = tokenize(tmp_path, *args, "--tokenizer", str(tok_dir), "--out", "tok", capsys=capsys,
                                monkeypatch=monkeypatch)  # fmt: skip
        assert (code, err.strip()) == (2, line) and not (tmp_path / "tok").exists()


def test_the_shipped_example(tmp_path: Path, capsys, monkeypatch) -> None:
    """docs/llama.md's command: examples/chat's conversations with its template and the shipped
    tokenizer (as the docs' exported base model has it), as transformers renders them; every
    conversation answered, in one or more turns."""
    from transformers import AutoTokenizer

    example = REPO / "examples" / "chat"
    template = (example / "template.jinja").read_text()
    convs = [json.loads(line)["messages"] for line in (example / "conversations.jsonl").read_text().splitlines()]
    code, out, err = tokenize(tmp_path, str(example / "conversations.jsonl"), "--chat", "--chat-template",
                              str(example / "template.jinja"), "--tokenizer", str(tf.shipped_tokenizer()), "--out",
                              "tok", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0, err
    hf = AutoTokenizer.from_pretrained(str(tf.shipped_tokenizer()))
    docs = read_shards(tmp_path / "tok")
    assert len(docs) == len(convs) >= 40 and f"{len(convs)} conversations" in out
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in convs)
    assert any(c[0]["role"] == "system" for c in convs)
    for (ids, mask, _), conv in zip(docs, convs, strict=True):
        assert ids.tolist() == reference_ids(hf, conv, chat_template=template)
        turns = [m["content"] + "<|end_of_text|>" for m in conv if m["role"] == "assistant"]
        assert trained_texts(hf, ids, mask) == turns
