"""data=sft: chat shards (written here in composerun-tokenize --chat's format,
tests/fixtures/chat.py) as packed or padded rows, the loss on the trained tokens only, packed
documents kept apart by composerun's Llama (block-causal attention, positions restarting at
each document) and by transformers' (position_ids), and the bad inputs' one-line refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cli, compose, final_weights, read_metrics, train
from fixtures.chat import VictimSFTData, random_docs, write_chat_shards

from composerun.data import SFTData
from composerun.data.sources import Packed, forward
from composerun.errors import ConfigError
from composerun.models import build_model
from composerun.models.hf import hf_config, hf_name

VOCAB, SEQ = 128, 24
# the runs here: no test reads a run's peak memory, so no step runs under torch's memory tracker
UNMEASURED = "metrics.track_memory=false"
TINY = (
    "+model=llama3_debug",
    "model.dim=32",
    "model.n_layers=2",
    f"model.vocab_size={VOCAB}",
    "model.kwargs.ffn_dim=64",
)
DOCS = random_docs(seed=5, count=14, lo=3, hi=19, vocab=VOCAB)  # uneven lengths: 3 to 18 tokens


def model_config() -> object:
    return compose(*TINY, validate=False).model


def source(path: Path, **kw: object) -> SFTData:
    kw = {"seq_len": SEQ, "val_fraction": 0.0, **kw}
    return SFTData(model_config(), seed=7, path=str(path), **kw)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config()).eval()


def test_packed_rows_keep_whole_documents_and_count_only_their_trained_targets(tmp_path: Path) -> None:
    """Epoch 0's rows hold every training document once, greedily packed; each row's inputs,
    positions and targets are those built here from the documents themselves: a target counts
    where the mask trains it, never at a document's first token or at padding."""
    data = source(write_chat_shards(tmp_path / "tok", DOCS, per_shard=5))
    rows = data.epoch(0)
    members = [rows.members(r) for r in range(rows.size)]
    assert sorted(d for m in members for d in m) == list(range(len(DOCS)))
    assert max(len(m) for m in members) >= 3, "no row packs several documents: the test sees nothing"
    x, y = data.batch(range(rows.size))
    assert isinstance(x, Packed)
    for r, m in enumerate(members):
        lengths = [len(DOCS[d][0]) for d in m]
        assert sum(lengths) <= SEQ + 1
        if r + 1 < rows.size:  # greedy: the next row's first document did not fit
            assert sum(lengths) + len(DOCS[members[r + 1][0]][0]) > SEQ + 1
        tok = np.concatenate([DOCS[d][0] for d in m]).astype(np.int64)
        keep = np.concatenate([np.r_[0, DOCS[d][1][1:]] for d in m]).astype(bool)
        pos = np.concatenate([np.arange(n) for n in lengths])
        n = len(tok)
        assert x.tokens[r, : min(n, SEQ)].tolist() == tok[:SEQ].tolist()
        assert x.position_ids[r, : min(n, SEQ)].tolist() == pos[:SEQ].tolist()
        want = np.where(keep[1:], tok[1:], -100)
        assert y[r, : n - 1].tolist() == want.tolist() and (y[r, n - 1 :] == -100).all()
    again = source(tmp_path / "tok")  # sample i is a pure function of (seed, i)
    x2, y2 = again.batch([3, 1, rows.size + 2])
    x1, y1 = data.batch([3, 1, rows.size + 2])
    assert torch.equal(x1.tokens, x2.tokens) and torch.equal(y1, y2) and torch.equal(x1.position_ids, x2.position_ids)


def test_padded_rows_are_one_document_each(tmp_path: Path) -> None:
    data = source(write_chat_shards(tmp_path / "tok", DOCS, per_shard=5), packing=False, seq_len=8)
    x, y = data.batch(range(len(DOCS)))
    assert isinstance(x, torch.Tensor) and x.shape == (len(DOCS), 8)
    seen = []
    for r in range(len(DOCS)):
        [d] = data.epoch(0).members(r)
        tok, mask = DOCS[d][0].astype(np.int64)[:9], DOCS[d][1][:9].astype(bool)
        seen.append(d)
        assert x[r, : len(tok)].tolist() == tok[:8].tolist() and (x[r, len(tok) :] == 0).all()
        assert y[r].tolist() == np.r_[np.where(mask[1:], tok[1:], -100), [-100] * (9 - len(tok))].tolist()
    assert sorted(seen) == list(range(len(DOCS)))


def per_token_losses(
    model: torch.nn.Module, x: Packed, docs: list[tuple[np.ndarray, np.ndarray]], members: list[int]
) -> torch.Tensor:
    """Row 0's loss at every position against the row's next token, whether it counts or not."""
    row = np.zeros(SEQ + 1, np.int64)
    tok = np.concatenate([docs[d][0] for d in members])[: SEQ + 1]
    row[: len(tok)] = tok
    with torch.no_grad():
        out = forward(model, x)[0]
    return F.cross_entropy(out.float(), torch.from_numpy(row[1:]), reduction="none")


def test_packed_documents_do_not_see_each_other(tmp_path: Path) -> None:
    """The isolation probe: changing one packed document's tokens leaves every other token's
    loss in its row unchanged (and changes its own), and each document's per-token losses are
    those of the document alone in a row of its own."""
    data = source(write_chat_shards(tmp_path / "a", DOCS, per_shard=14))
    rows = data.epoch(0)
    r = max(range(rows.size), key=lambda r: len(rows.members(r)))
    members = rows.members(r)
    victim = members[1]
    changed = [(t if d != victim else (t + 1) % VOCAB, m) for d, (t, m) in enumerate(DOCS)]
    other = source(write_chat_shards(tmp_path / "b", changed, per_shard=14))
    model = tiny_llama()
    x, _ = data.batch([r])
    x2, _ = other.batch([r])
    got, got2 = per_token_losses(model, x, DOCS, members), per_token_losses(model, x2, changed, members)
    starts = np.cumsum([0] + [len(DOCS[d][0]) for d in members])
    lo, hi = int(starts[1]), int(starts[2])  # the victim's tokens in the row
    outside = torch.ones(SEQ, dtype=torch.bool)
    outside[max(lo - 1, 0) : hi] = False  # its tokens as inputs (lo .. hi-1) or as the target at lo-1
    torch.testing.assert_close(got[outside], got2[outside], rtol=0, atol=1e-6)
    assert (got[~outside] - got2[~outside]).abs().max() > 1e-3, "the changed document's losses did not change"
    for k, d in enumerate(members):  # each document alone
        tok = torch.from_numpy(DOCS[d][0].astype(np.int64))
        a, b = int(starts[k]), int(starts[k + 1])
        with torch.no_grad():
            alone = F.cross_entropy(model(tok[None, :-1])[0].float(), tok[1:], reduction="none")
        torch.testing.assert_close(got[a : b - 1], alone, rtol=0, atol=1e-5)


def hf_twin(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with the weights of composerun's `model` (sdpa attention,
    no key/value cache: as +model=hf builds it, models/hf_causal.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**hf_config(model), attn_implementation="sdpa", use_cache=False))
    hf.load_state_dict({hf_name(k): v for k, v in model.state_dict().items()})
    return hf.eval()


def test_packed_loss_is_transformers_loss_of_each_document_token_weighted(tmp_path: Path) -> None:
    """A packed batch's masked loss (composerun's Llama) equals transformers' LlamaForCausalLM run
    on each document separately with ignore_index cross-entropy, weighted by the tokens that
    count; transformers' own model given the packed rows with position_ids (+model=hf's path)
    gives it too."""
    data = source(write_chat_shards(tmp_path / "tok", DOCS, per_shard=4))
    model = tiny_llama()
    hf = hf_twin(model)
    rows = list(range(data.epoch(0).size))
    x, y = data.batch(rows)
    with torch.no_grad():
        got = data.loss(forward(model, x), y).item()
        via_hf = data.loss(forward(hf, x).logits, y).item()
        total, count = 0.0, 0
        for r in rows:
            for d in data.epoch(0).members(r):
                tok = torch.from_numpy(DOCS[d][0].astype(np.int64))[None, : SEQ + 1]
                labels = torch.where(torch.from_numpy(DOCS[d][1][: SEQ + 1]).bool()[None], tok, -100)
                logits = hf(tok).logits[:, :-1]
                total += F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum").item()
                count += int((labels[:, 1:] != -100).sum())
    assert count == int((y != -100).sum())
    assert got == pytest.approx(total / count, abs=1e-5)
    assert via_hf == pytest.approx(total / count, abs=1e-5)


def test_bad_sft_data_is_one_line(tmp_path: Path) -> None:
    plain = write_chat_shards(tmp_path / "plain", DOCS, per_shard=5, chat=False)
    with pytest.raises(ConfigError, match="data=sft needs shards from composerun-tokenize --chat"):
        source(plain)
    chat = write_chat_shards(tmp_path / "chat", DOCS, per_shard=5)
    with pytest.raises(ConfigError, match=r"data.seq_len=1 is too small"):
        source(chat, seq_len=1)
    late = [(t, np.r_[np.zeros(len(t) - 1, np.uint8), [1]].astype(np.uint8)) for t, _ in DOCS if len(t) > 6]
    with pytest.raises(ConfigError, match=r"data.seq_len=4 is too small: no training document"):
        source(write_chat_shards(tmp_path / "late", late, per_shard=5), seq_len=4)
    with pytest.raises(ConfigError, match="too few to hold out one"):
        source(write_chat_shards(tmp_path / "one", DOCS, per_shard=1), val_fraction=0.1)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tokens_00000.bin").write_bytes(b"")
    (empty / "tokens_00000.loss_mask").write_bytes(b"")
    (empty / "tokens_00000.doc_starts").write_bytes(b"")
    meta = '{"tokens": 0, "dtype": "uint16", "chat": true, "loss_mask": "tokens_00000.loss_mask", "doc_starts": "tokens_00000.doc_starts"}'
    (empty / "tokens_00000.json").write_text(meta)
    with pytest.raises(ConfigError, match="the held-out split has no document"):
        source(chat, val_path=str(empty))


@pytest.mark.e2e
def test_the_command_refuses_shards_without_a_loss_mask(tmp_path: Path) -> None:
    plain = write_chat_shards(tmp_path / "plain", DOCS, per_shard=5, chat=False)
    p = cli(*TINY, "data=sft", f"data.path={plain}", "train.steps=1", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "data=sft needs shards from composerun-tokenize --chat" in lines[0], p.stderr


def hf_loss_of(hf: torch.nn.Module, docs: object, members: list[int]) -> tuple[float, int]:
    """(summed loss, targets counted) of transformers' model on each document alone, read from
    the shard files here (its first SEQ+1 tokens, the targets its mask trains)."""
    total, count = 0.0, 0
    for d in members:
        k, lo, hi = (int(v) for v in docs.spans[d])
        shard = docs.shards[k][0]
        tok = np.fromfile(shard, np.uint16)[lo:hi].astype(np.int64)[: SEQ + 1]
        mask = np.fromfile(shard.with_suffix(".loss_mask"), np.uint8)[lo:hi][: SEQ + 1].astype(bool)
        labels = torch.from_numpy(np.where(mask, tok, -100))[None, 1:]
        with torch.no_grad():
            logits = hf(torch.from_numpy(tok)[None]).logits[:, :-1]
        total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        count += int((labels != -100).sum())
    return total, count


@pytest.mark.distributed
def test_sft_trains_on_mesh_2_with_the_token_weighted_loss(tmp_path: Path) -> None:
    """data=sft packed on mesh 2 (FSDP, two micro-batches a step) from weights saved here: the
    first step's logged loss is transformers' token-weighted loss of the global batch's
    documents, each run alone, and the validation loss after the last step is the same of the
    held-out documents with the trained weights."""
    from safetensors.torch import save_file

    docs = random_docs(seed=9, count=40, lo=4, hi=19, vocab=VOCAB)
    path = write_chat_shards(tmp_path / "tok", docs, per_shard=20)
    model = tiny_llama()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "start.safetensors")
    ov = (*TINY, "data=sft", f"data.path={path}", f"data.seq_len={SEQ}", "data.val_fraction=0.1", "data.batch_size=4")
    ov += ("train.grad_accum=2", "train.steps=3", "eval.every=3", "eval.batches=1", "optim.lr=1e-2")
    ov += (f"checkpoint.init_from={tmp_path / 'start.safetensors'}",)
    train(tmp_path / "run", *ov, "mesh=2", "sharding=fsdp", UNMEASURED)
    rows = read_metrics(tmp_path / "run")
    data = SFTData(
        model_config(), seed=compose(*ov, validate=False).data.seed, path=str(path), seq_len=SEQ, val_fraction=0.1
    )
    members = [d for i in range(4) for d in data.epoch(data.row_of(i)[0]).members(data.row_of(i)[1])]  # step 1's
    total, count = hf_loss_of(hf_twin(model), data.train, members)
    assert rows[0]["loss"] == pytest.approx(total / count, abs=1e-5)
    trained = tiny_llama()
    trained.load_state_dict(final_weights(tmp_path / "run", *ov))
    held = [d for i in range(4) for d in data.val.members(i % data.val.size)]
    assert len(held) >= 4
    total, count = hf_loss_of(hf_twin(trained), data.val.docs, held)
    assert rows[-1]["val_loss"] == pytest.approx(total / count, abs=1e-5)


@pytest.mark.distributed
def test_packed_documents_do_not_see_each_other_under_fsdp_tp(tmp_path: Path) -> None:
    """The isolation probe on mesh 2x2 (FSDP over `shard`; tensor and sequence parallelism and
    the vocabulary-sharded loss over `tp`): shards that differ only in one packed document's
    tokens, that document's targets uncounted (tests/fixtures/chat.py VictimSFTData), log the
    same first loss, which is one process's loss of the same rows.  The control, the same rows
    with plain causal attention across documents, tells the two shards apart."""
    from safetensors.torch import save_file

    docs = random_docs(seed=11, count=24, lo=3, hi=12, vocab=VOCAB)
    ov = (*TINY, "data=sft", "data._target_=fixtures.chat.VictimSFTData", f"data.seq_len={SEQ}", "data.batch_size=4")
    seed = compose(*ov, validate=False).data.seed
    probe = SFTData(model_config(), seed=seed, path=str(write_chat_shards(tmp_path / "a", docs, 24)), seq_len=SEQ)
    probe.val = None
    rows = [probe.epoch(0).members(r) for r in range(4)]  # step 1's samples
    victim = next(m[0] for m in rows if len(m) >= 2)
    changed = [(t if d != victim else (t + 1) % VOCAB, m) for d, (t, m) in enumerate(docs)]
    write_chat_shards(tmp_path / "b", changed, 24)
    model = tiny_llama()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "start.safetensors")
    ov += (f"checkpoint.init_from={tmp_path / 'start.safetensors'}", "train.steps=1", "checkpoint.at_end=false")
    logged, here, control = {}, {}, {}
    for name in ("a", "b"):
        (tmp_path / name / "victim").write_text(f"doc={victim}")
        train(tmp_path / f"run-{name}", *ov, f"data.path={tmp_path / name}", "mesh=2x2", "sharding=fsdp_tp", UNMEASURED)
        logged[name] = read_metrics(tmp_path / f"run-{name}")[0]["loss"]
        data = VictimSFTData(model_config(), seed=seed, path=str(tmp_path / name), seq_len=SEQ)
        x, y = data.batch(range(4))
        (tmp_path / name / "victim").write_text(f"doc={victim} causal=1")
        xc, yc = VictimSFTData(model_config(), seed=seed, path=str(tmp_path / name), seq_len=SEQ).batch(range(4))
        with torch.no_grad():
            here[name] = data.loss(forward(model, x), y).item()
            control[name] = data.loss(forward(model, xc), yc).item()
    assert logged["a"] == pytest.approx(logged["b"], abs=1e-6)
    assert logged["a"] == pytest.approx(here["a"], abs=1e-5)
    assert abs(control["a"] - control["b"]) > 1e-4, f"the control sees no difference: {control}"


@pytest.mark.distributed
def test_resumed_on_another_mesh_it_ends_bit_equal(tmp_path: Path) -> None:
    """A packed data=sft run on mesh 2 (uneven masks: each rank counts another number of targets)
    checkpointed at step 2, as a killed run leaves it; that checkpoint resumed on mesh 1 with two
    micro-batches a step (each the rows one rank of mesh 2 took) trains steps 3 and 4 and ends
    with the uninterrupted run's weights bit for bit (the data position, the token-weighted
    loss's count and the optimizer state all carried over)."""
    docs = random_docs(seed=13, count=40, lo=3, hi=19, vocab=VOCAB)
    path = write_chat_shards(tmp_path / "tok", docs, per_shard=20)
    ov = (*TINY, "data=sft", f"data.path={path}", f"data.seq_len={SEQ}", "data.batch_size=4", "optim.lr=1e-2")
    ov += ("train.steps=4", "checkpoint.every=2", "sharding=fsdp")
    train(tmp_path / "whole", *ov, "mesh=2", UNMEASURED)
    step2 = tmp_path / "whole" / "checkpoints" / "step-00000002"
    train(tmp_path / "resumed", *ov, "mesh=1", "train.grad_accum=2", f"checkpoint.resume={step2}", UNMEASURED)
    assert [r["step"] for r in read_metrics(tmp_path / "resumed") if "loss" in r] == [3, 4]
    want, got = final_weights(tmp_path / "whole", *ov), final_weights(tmp_path / "resumed", *ov)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"resumed on mesh 1: not bit-equal to the uninterrupted run: {differ[:3]}"
    import torch.distributed.checkpoint as dcp

    at2 = {k: v.clone() for k, v in want.items()}
    dcp.load({"model": at2}, checkpoint_id=str(step2))
    assert any(not torch.equal(at2[k], want[k]) for k in want)  # (the resumed run trained after the load)


def test_the_estimate_counts_the_packed_rows_mask(tmp_path: Path) -> None:
    """plan=true's estimate of a packed data=sft run runs the model's masked attention: its peak
    holds at least the block-causal mask (a byte per query-key pair of a micro-batch) beyond the
    same run on token windows, and its step takes longer; padded rows (plain causal attention)
    estimate as token windows do."""
    from composerun.parallel.planner import plan_offline

    path = write_chat_shards(tmp_path / "tok", random_docs(seed=3, count=30, lo=20, hi=200, vocab=VOCAB), 30)
    common = (*TINY, "model.seq_len=256", "data.seq_len=256", "data.batch_size=8", "mesh=2", "plan.device=H100")
    est = {
        name: plan_offline(compose(*common, *over))[0]["estimate"]
        for name, over in {
            "tokens": ["data=tokens"],
            "packed": ["data=sft", f"data.path={path}"],
            "padded": ["data=sft", f"data.path={path}", "data.packing=false"],
        }.items()
    }
    peak = {k: max(e["peak_bytes_per_rank"]) for k, e in est.items()}
    micro = est["packed"]["micro_batch"]
    assert micro == 4 and peak["packed"] - peak["tokens"] >= micro * 256 * 256, peak
    assert peak["padded"] == peak["tokens"]
    assert est["packed"]["step_time"]["step_s"] > est["tokens"]["step_time"]["step_s"]


def test_packing_off_is_refused_by_a_source_that_packs_nothing() -> None:
    from composerun.data import build_data

    with pytest.raises(
        ConfigError, match="data.packing=false: data._target_=composerun.data.TokenData packs no documents"
    ):
        build_data(compose(*TINY, "data=tokens", "data.packing=false", validate=False))
