"""Token data (`data=tokens`, composerun/data/tokens.py) and composerun-tokenize.

Pure tier: the sample order is a function of (seed, index) only, each epoch visits every
training window once, the held-out windows are disjoint from the training ones and read in
order, the shards are memory-mapped (nothing loaded whole), `.npy` files, directories and
globs.  End-to-end: every bad input of the data side is one line and exit 2 with nothing
written; composerun-tokenize on text, JSONL and Parquet; a short run on the shipped shards.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import compose, read_metrics, train

from composerun.data import SyntheticData, TextData, TokenData, build_data
from composerun.data import token_files as tf
from composerun.errors import ConfigError

LLAMA = ("+model=llama3_debug", "data=tokens")


def model_cfg(vocab: int = 1 << 20, seq_len: int = 8, max_seq_len: int | None = None):
    cfg = compose("+model=transformer", f"model.vocab_size={vocab}", f"model.seq_len={seq_len}").model
    cfg.kwargs = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
    return cfg


def positions(folder: Path, sizes: list[int], suffix: str = ".bin") -> list[Path]:
    """Shards whose tokens are their global positions (uint32): a token says where it was read."""
    out, start = [], 0
    for k, n in enumerate(sizes):
        p = folder / f"part_{k}{suffix}"
        arr = np.arange(start, start + n, dtype=np.uint32)
        np.save(p, arr) if suffix == ".npy" else arr.tofile(p)
        out.append(p)
        start += n
    return out


def test_samples_are_a_function_of_seed_and_index(tmp_path: Path) -> None:
    """Any split of the indices (ranks, micro-batches, a resume) reads the same samples; an
    epoch visits every training window once; the next epoch and another seed reorder them."""
    positions(tmp_path, [203, 150])
    data = TokenData(model_cfg(), seed=7, path=str(tmp_path), token_dtype="uint32", val_fraction=0)
    whole = data.batch(range(40))
    again = TokenData(model_cfg(), seed=7, path=str(tmp_path), token_dtype="uint32", val_fraction=0)
    parts = [again.batch(range(a, b)) for a, b in ((30, 40), (0, 3), (3, 30))]  # (out of order, too)
    assert torch.equal(whole[0], torch.cat([parts[1][0], parts[2][0], parts[0][0]]))
    assert torch.equal(whole[1], whole[0] + 1)  # targets are the inputs shifted by one
    w = data.train.count
    assert w == (202 // 8) + (149 // 8)
    first, second = [[data.window_of(i) for i in range(e * w, (e + 1) * w)] for e in (0, 1)]
    assert sorted(first) == sorted(second) == list(range(w)) and first != second
    other = TokenData(model_cfg(), seed=8, path=str(tmp_path), token_dtype="uint32", val_fraction=0)
    assert [other.window_of(i) for i in range(w)] != first
    # no window crosses the shards' boundary (positions 203 and on are the second shard's)
    x = data.batch(range(w))[0]
    assert not ((x[:, 0] < 203) & (x[:, -1] >= 202)).any()


def test_held_out_is_disjoint_from_training_and_read_in_order(tmp_path: Path) -> None:
    positions(tmp_path, [1000, 500])
    data = TokenData(model_cfg(), seed=1, path=str(tmp_path), token_dtype="uint32", val_fraction=0.1)
    seen = torch.cat([torch.cat(data.batch(range(i, i + 1))).flatten() for i in range(data.train.count)])
    val = data.val
    held = torch.cat([torch.cat(val.batch([i])).flatten() for i in range(val.size)])
    assert not set(seen.tolist()) & set(held.tolist())
    # the last 10% of each shard, in consecutive windows, the same every time (and wrapping)
    assert val.size == (100 - 1) // 8 + (50 - 1) // 8
    assert torch.equal(val.batch([0])[0][0], torch.arange(900, 908))
    assert torch.equal(val.batch([1])[0][0], torch.arange(908, 916))
    assert torch.equal(val.batch([val.size - 1])[0][0], torch.arange(1000 + 450 + 40, 1000 + 450 + 48))
    assert torch.equal(val.batch([val.size])[0], val.batch([0])[0])
    assert seen.max() < 1450 and held.min() >= 900


def test_val_path_and_no_held_out(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir(), (tmp_path / "val").mkdir()
    positions(tmp_path / "train", [100])
    np.arange(5000, 5040, dtype=np.uint32).tofile(tmp_path / "val" / "v.bin")
    data = TokenData(model_cfg(), path=str(tmp_path / "train"), val_path=str(tmp_path / "val"), token_dtype="uint32")
    assert data.train.count == 99 // 8  # every training token trains
    assert data.val.size == 39 // 8 and data.val.batch([0])[0][0, 0] == 5000
    assert TokenData(model_cfg(), path=str(tmp_path / "train"), val_fraction=0, token_dtype="uint32").val is None


def test_npy_shards_a_glob_and_a_single_file(tmp_path: Path) -> None:
    files = positions(tmp_path, [60, 70, 80], suffix=".npy")
    (tmp_path / "notes.txt").write_text("not a shard")
    by_glob = TokenData(model_cfg(), path=str(tmp_path / "part_*.npy"), val_fraction=0)
    by_dir = TokenData(model_cfg(), path=str(tmp_path), val_fraction=0)
    assert [r[0] for r in by_glob.train.regions] == [r[0] for r in by_dir.train.regions] == files
    assert torch.equal(by_glob.batch(range(20))[0], by_dir.batch(range(20))[0])
    one = TokenData(model_cfg(), path=str(files[1]), val_fraction=0)
    assert one.train.count == 69 // 8 and set(torch.cat(one.batch(range(8))).flatten().tolist()) <= set(range(60, 130))


def test_shards_are_memory_mapped_never_loaded(tmp_path: Path) -> None:
    """A 16 MB shard: building the source, a batch, the launcher's vocabulary scan (no sidecar)
    and pickling it (a spawned DataLoader worker) allocate under 1 MB (the epoch's permutation,
    8 bytes a window: 256 KB here)."""
    (np.arange(8 << 20) % 50_000).astype(np.uint16).tofile(tmp_path / "big.bin")
    cfg = compose(*LLAMA, f"data.path={tmp_path / 'big.bin'}", "model.vocab_size=50000", "data.seq_len=256")
    from composerun.data.tokens import check_tokens

    tracemalloc.start()
    try:
        data = build_data(cfg)
        x, _ = data.batch(range(8))
        check_tokens(cfg, data)
        blob = pickle.dumps(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(data.train._maps[0], np.memmap) and x.shape == (8, 256)
    assert peak < 1 << 20, f"{peak} bytes allocated"
    assert len(blob) < 100_000 and torch.equal(pickle.loads(blob).batch(range(8))[0], x)


def test_id_range_scans_signed_shards_for_negative_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk by chunk (the -3 lies in a later chunk than the first), and a signed shard is
    scanned even where a sidecar records its largest id (a sidecar records no smallest)."""
    monkeypatch.setattr(tf, "SCAN_CHUNK", 16)
    ids = np.array([5] * 50 + [-3] + [7] * 10, dtype=np.int32)
    np.save(tmp_path / "a.npy", ids)
    (tmp_path / "a.json").write_text(json.dumps({"tokens": 61, "max_id": 7, "dtype": "int32"}))
    assert tf.id_range(tmp_path / "a.npy", None) == (-3, 7)
    np.save(tmp_path / "b.npy", np.abs(ids).astype(np.uint32))
    (tmp_path / "b.json").write_text(json.dumps({"tokens": 61, "max_id": 9, "dtype": "uint32"}))
    assert tf.id_range(tmp_path / "b.npy", None) == (0, 9)  # unsigned: the sidecar's record, unread


def test_shipped_shards_tokenizer_and_sources_with_val() -> None:
    """data=tokens' default reads the shipped shards, whose sidecar names the shipped
    tokenizer; data.seq_len reaches every shipped source; synthetic and text data hold out too."""
    cfg = compose(*LLAMA, "data.seq_len=32")
    data = build_data(cfg)
    from composerun.data.tokens import run_tokenizer

    assert data.seq_len == 32 and data.batch([0])[0].shape == (1, 32) and data.val.size >= 10
    assert run_tokenizer(cfg) == tf.shipped_tokenizer() / "tokenizer.json"
    assert tf.tokenizer_vocab_size(run_tokenizer(cfg), "data.tokenizer") == cfg.model.vocab_size == 2048
    text = build_data(compose("+model=transformer", "data=text", "data.seq_len=16", "data.val_fraction=0.2"))
    assert isinstance(text, TextData) and text.batch([3])[0].shape == (1, 16)
    assert len(text.tokens) == 5548 - 1110 and text.val.size == (1110 - 1) // 16
    held = bytes(text.val.batch([0])[0][0].tolist()).decode()
    assert held in (Path(tf.shipped_shards()).parent / "sonnets.txt").read_text()[-1110:]
    synthetic = build_data(compose("+model=transformer"))
    assert isinstance(synthetic, SyntheticData) and synthetic.val.size > 0
    v = synthetic.val.batch(range(4))[0]
    assert torch.equal(v, synthetic.val.batch(range(4))[0]) and not torch.equal(v, synthetic.batch(range(4))[0])


def test_the_shipped_tokenizer_loads_in_transformers() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tf.shipped_tokenizer()))
    assert len(tok) == 2048 and tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|end_of_text|>"
    ids = tok("Shall I compare thee to a summer's day?")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "Shall I compare thee to a summer's day?"


def test_build_data_refuses_a_val_path_for_a_source_that_reads_none() -> None:
    with pytest.raises(
        ConfigError, match=r"^data.val_path=x: data._target_=composerun.data.SyntheticData reads no file"
    ):
        build_data(compose("+model=transformer", "data.val_path=x"))


# --- bad inputs, one line each ---------------------------------------------------------------


def bad_cases(root: Path) -> dict[str, tuple[tuple[str, ...], str]]:
    """name: (overrides, the one line the command must print)."""
    (root / "empty").mkdir()
    (root / "empty" / "a.bin").write_bytes(b"")
    (root / "high").mkdir()
    np.array([1, 2, 3000] * 40, dtype=np.uint16).tofile(root / "high" / "a.bin")  # no sidecar: scanned
    (root / "told").mkdir()
    np.array([1, 2, 3] * 40, dtype=np.uint16).tofile(root / "told" / "a.bin")
    (root / "told" / "a.json").write_text(json.dumps({"tokens": 120, "max_id": 4096, "dtype": "uint16"}))
    big = root / "big_tokenizer"
    big.mkdir()
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(3000)}, unk_token="w0")).save(str(big / "tokenizer.json"))
    junk = root / "junk_tokenizer"
    junk.mkdir()
    (junk / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(Exception) as why:  # the tokenizers library's own words, whatever its version
        Tokenizer.from_file(str(junk / "tokenizer.json"))
    (root / "negative").mkdir()
    np.save(root / "negative" / "a.npy", np.array([1, 2, 3] * 40 + [-3] + [4] * 40, dtype=np.int64))
    e = "composerun: error: "
    return {
        "no_match": (("data.path=nowhere/*.bin",), f"{e}data.path=nowhere/*.bin: matches no .bin or .npy token file; "
                     "tokenize text with composerun-tokenize, or name a file, a directory or a glob of shards"),
        "empty": ((f"data.path={root / 'empty'}",), f"{e}data.path: {root / 'empty' / 'a.bin'} holds no tokens; "
                  "remove it from the shards, or shorten data.seq_len"),
        "short": ((f"data.path={root / 'high'}", "data.seq_len=200"), f"{e}data.path: {root / 'high' / 'a.bin'} holds 120 "
                  "tokens, fewer than data.seq_len+1=201; remove it from the shards, or shorten data.seq_len"),
        "id_scanned": ((f"data.path={root / 'high'}", "data.seq_len=16"), f"{e}data.path: {root / 'high' / 'a.bin'} holds "
                       "token id 3000, not below model.vocab_size=2048: tokenize with the model's tokenizer (or check "
                       "data.token_dtype)"),
        "id_recorded": ((f"data.path={root / 'told'}", "data.seq_len=16"), f"{e}data.path: {root / 'told' / 'a.bin'} holds "
                        "token id 4096, not below model.vocab_size=2048: tokenize with the model's tokenizer (or check "
                        "data.token_dtype)"),
        "seq_len": (("data.seq_len=512",), f"{e}data.seq_len=512 is larger than the model's max_seq_len=256 "
                    "(model.kwargs.max_seq_len): shorten data.seq_len, or raise model.kwargs.max_seq_len"),
        "tokenizer": ((f"data.tokenizer={big}",), f"{e}data.tokenizer: the tokenizer {big / 'tokenizer.json'} has 3000 "
                      "tokens, more than model.vocab_size=2048: use the model's own tokenizer, or a model whose "
                      "vocabulary holds it"),
        "junk_tokenizer": ((f"data.tokenizer={junk}",), f"{e}data.tokenizer: {junk / 'tokenizer.json'} is not a Hugging "
                           f"Face tokenizer.json ({str(why.value).splitlines()[0]}); name a tokenizer.json (or a "
                           "directory with one) that the tokenizers library reads"),
        "negative_id": ((f"data.path={root / 'negative'}", "data.seq_len=16"), f"{e}data.path: {root / 'negative' / 'a.npy'} "
                        "holds token id -3, below 0: token ids run from 0 to model.vocab_size-1; tokenize with the "
                        "model's tokenizer (or check the array's values)"),
        "recorded_tokenizer": (("model.vocab_size=1024",), f"{e}data.path: {tf.shipped_shards() / 'tokens_00000.bin'} was "
                               f"tokenized with {tf.shipped_tokenizer() / 'tokenizer.json'} (2048 tokens), more than "
                               "model.vocab_size=1024: tokenize with the model's tokenizer, or choose a model whose "
                               "vocabulary holds it"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every command of this module that starts no rank, one after another in one process
    (scripts/one_process.py), each through the function its console script calls, each in its
    own directory: the bad token data (they fail their checks before any rank starts), a plan
    without the data ("plan"), composerun-tokenize's bad inputs ("tokenize_bad") and its run on
    text, JSONL and Parquet ("tokenize")."""
    from one_process import run_commands

    root = tmp_path_factory.mktemp("bad_tokens")
    cases = bad_cases(root)
    assert sorted(cases) == sorted(BAD), "every case has its test"
    for name in cases:
        (root / f"cwd_{name}").mkdir()
    (root / "cwd_plan").mkdir()
    plan = [*LLAMA, "data.path=nowhere/*.bin", "mesh=2", "plan=true", "hydra.run.dir=run"]
    tokenize_bad = tokenize_bad_cases(tmp_path_factory.mktemp("tokenize_bad"))
    good_dir = tmp_path_factory.mktemp("tokenize")
    procs = run_commands(
        [
            *(
                ([*LLAMA, *over, "train.steps=1", "hydra.run.dir=run"], root / f"cwd_{name}")
                for name, (over, _) in cases.items()
            ),
            (plan, root / "cwd_plan"),
            *(([*args, "--out", "out"], d, "composerun-tokenize") for args, (d, _) in tokenize_bad.items()),
            (tokenize_text_jsonl_and_parquet(good_dir), good_dir, "composerun-tokenize"),
        ]
    )
    n = len(cases) + 1
    lines = {name: line for name, (_, line) in cases.items()}
    bad = {
        name: (proc, root / f"cwd_{name}", lines.get(name, ""))
        for name, proc in zip([*cases, "plan"], procs[:n], strict=True)
    }
    tokenized = [
        (args, d, line, proc) for (args, (d, line)), proc in zip(tokenize_bad.items(), procs[n:-1], strict=True)
    ]
    return {"bad": bad, "tokenize_bad": tokenized, "tokenize": (procs[-1], good_dir)}


@pytest.fixture
def bad_results(commands: dict[str, Any]) -> dict[str, tuple[subprocess.CompletedProcess, Path, str]]:
    """Every case's command, its working directory and the line it must print."""
    return commands["bad"]


BAD = [
    "no_match", "empty", "short", "id_scanned", "id_recorded", "seq_len", "tokenizer", "junk_tokenizer",
    "negative_id", "recorded_tokenizer",
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("name", BAD)
def test_bad_token_data_is_one_line_and_exit_2(name: str, bad_results) -> None:
    r, cwd, line = bad_results[name]
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == line
    assert not (cwd / "run").exists(), "nothing is written"


# --- composerun-tokenize --------------------------------------------------------------------


def tokenize_text_jsonl_and_parquet(cwd: Path) -> list[str]:
    """A .txt, a JSONL and a Parquet file in `cwd`; the arguments that tokenize them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (cwd / "a.txt").write_text("Shall I compare thee\nto a summer's day?\n\nThou art more lovely.\n\n\n")
    (cwd / "b.jsonl").write_text(
        json.dumps({"body": "And summer's lease"}) + "\n" + json.dumps({"body": "hath all"}) + "\n"
    )
    pq.write_table(pa.table({"body": ["too short a date.", "Sometime too hot"]}), cwd / "c.parquet")
    return ["a.txt", "b.jsonl", "c.parquet", "--tokenizer", str(tf.shipped_tokenizer()), "--out", "out", "--text-key",
            "body", "--shard-tokens", "20", "--num-proc", "2"]  # fmt: skip


@pytest.mark.e2e
def test_tokenize_text_jsonl_and_parquet(commands: dict[str, Any]) -> None:
    """Paragraphs of a .txt, rows of a JSONL and a Parquet file: each document encoded with
    its BOS, followed by EOS, in order, in shards of at most --shard-tokens with sidecars; the
    shards train as data=tokens."""
    from tokenizers import Tokenizer

    r, tmp_path = commands["tokenize"]
    tok_dir = tf.shipped_tokenizer()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "writing shards" in r.stderr  # the progress bar
    shards = sorted((tmp_path / "out").glob("*.bin"))
    ids = np.concatenate([np.fromfile(s, dtype=np.uint16) for s in shards])
    metas = [json.loads(s.with_suffix(".json").read_text()) for s in shards]
    assert [m["tokens"] for m in metas[:-1]] == [20] * (len(shards) - 1) and metas[-1]["tokens"] <= 20
    assert all(m["max_id"] == int(np.fromfile(s, dtype=np.uint16).max()) for m, s in zip(metas, shards, strict=True))
    assert (
        metas[0]["vocab_size"] == 2048
        and (tmp_path / "out" / metas[0]["tokenizer"]).resolve() == tok_dir / "tokenizer.json"
    )
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos, bos = tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|begin_of_text|>")
    docs = [tok.decode(list(d)) for d in np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]]
    assert docs == ["Shall I compare thee\nto a summer's day?", "Thou art more lovely.", "And summer's lease",
                    "hath all", "too short a date.", "Sometime too hot"]  # fmt: skip
    assert ids[0] == bos and ids[-1] == eos
    data = TokenData(model_cfg(vocab=2048, seq_len=4), path=str(tmp_path / "out"), val_fraction=0)
    assert data.train.count > 0 and not list(tmp_path.glob(".out.tmp-*"))


def tokenize_bad_cases(root: Path) -> dict[tuple[str, ...], tuple[Path, str]]:
    """composerun-tokenize's bad inputs, each in a directory of its own: args -> (its directory,
    the line it must print)."""
    tok = str(tf.shipped_tokenizer())
    e = "composerun-tokenize: error: "
    cases = {
        ("nope.txt", "--tokenizer", tok): f"{e}nope.txt: no such file",
        ("a.csv", "--tokenizer", tok): f"{e}a.csv: unknown kind of file; give .txt, .jsonl/.json or .parquet files",
        ("a.txt", "--tokenizer", "no_tok"): f"{e}--tokenizer=no_tok: no tokenizer.json there; name a Hugging Face "
                                             "tokenizer.json or a directory with one",
        # the text is tokenized first, then the JSONL fails: nothing of the text is left
        ("a.txt", "b.jsonl", "--tokenizer", tok): f"{e}--text-key=text: b.jsonl has no such column (columns: body)",
    }  # fmt: skip
    cases[("a.txt", "--tokenizer", tok)] = f"{e}--out=out: exists and is not an empty folder; name a new one"
    dirs = [root / f"case{k}" for k in range(len(cases))]
    for d in dirs:
        d.mkdir()
        (d / "a.txt").write_text("some text\n")
        (d / "a.csv").write_text("text\nx\n")
        (d / "b.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (dirs[-1] / "out").mkdir()
    (dirs[-1] / "out" / "x").write_text("")
    return {args: (d, line) for (args, line), d in zip(cases.items(), dirs, strict=True)}


@pytest.mark.e2e
def test_tokenize_bad_inputs_are_one_line_and_leave_nothing(commands: dict[str, Any]) -> None:
    """Each in a directory of its own, the commands one after another in one process
    (scripts/one_process.py: through the function the console script calls)."""
    tokenized = commands["tokenize_bad"]
    assert len(tokenized) == 5
    for k, (args, d, line, r) in enumerate(tokenized):
        if k == len(tokenized) - 1:  # the one line, and the folder as it was
            assert (r.returncode, r.stderr.strip()) == (2, line), r.stderr
            assert [p.name for p in (d / "out").iterdir()] == ["x"]
            continue
        assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (2, line), r.stderr
        assert sorted(p.name for p in d.iterdir()) == ["a.csv", "a.txt", "b.jsonl"], f"{args}: nothing written"


# --- runs -------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_llama_trains_on_the_shipped_shards(run_dir: Path) -> None:
    """+model=llama3_debug data=tokens on 2 ranks: train and validation loss fall (the training
    loss by 1.4 in these 12 steps, the held-out loss at each of steps 4, 8 and 12)."""
    train(run_dir, *LLAMA, "mesh=2", "sharding=fsdp_blocks", "train.steps=12", "optim.lr=3e-3", "eval.every=4",
          "eval.batches=2", "metrics.track_memory=false")  # fmt: skip
    rows = read_metrics(run_dir)
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, [r["loss"] for r in rows]
    assert len(val) == 3 and val[0] > val[1] > val[2], val


@pytest.mark.e2e
def test_plan_does_not_need_the_data(bad_results) -> None:
    r, cwd, _ = bad_results["plan"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((cwd / "run" / "summary.json").read_text())["status"] == "planned"
