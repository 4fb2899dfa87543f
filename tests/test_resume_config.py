"""A resume trains with the config given and says how it differs from the checkpoint's
(composerun/train/resume.py): the optimizer's hyper-parameters come from the config, not from
the checkpoint's param groups; each differing key is one log line on rank 0; a change of the
LR schedule states the LR's jump; and the last step trains at optim.lr * optim.min_lr_ratio."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import assert_close_weights, choose_start, compose, final_weights, read_metrics, train

from composerun.config.typed import to_plain
from composerun.train.optim import lr_factor
from composerun.train.resume import config_differences, keep_given_hyperparameters, resume_lines

# A tiny run: 8 features, one data-parallel rank, AdamW's loop (not fused: the same either way).
TINY = ("+model=unit", "model.dim=8", "optim.kwargs.fused=false", "metrics.progress=false")
WARN, INFO = logging.WARNING, logging.INFO


@contextmanager
def composerun_log():
    """The composerun logger's records at INFO and above, whatever an earlier in-process run
    (a 1-rank launch sets the logger up for its run directory, without propagation) left."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("composerun")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def resume_records(records: list[logging.LogRecord]) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in records if r.getMessage().startswith("resume:")]


# --- pure: what is said, and at what level ----------------------------------------------------


def test_each_difference_is_one_line_and_ignored_keys_none():
    before = to_plain(compose(*TINY))
    after = to_plain(
        compose(
            *TINY,
            "optim.weight_decay=0.5",
            "optim.kwargs.betas=[0.8,0.9]",
            "mesh=2",
            "sharding.param_dtype=bfloat16",
            "sharding.rules.0.reshard_after_forward=false",
            # none of these is said: they do not change what is trained
            "checkpoint.keep=5",
            "checkpoint.resume=never",
            "metrics.tensorboard=true",
            "launch.omp_threads=1",
            "train.log_every=3",
            "train.seed=7",
        )
    )
    assert config_differences(before, after) == [
        (INFO, "resume: mesh.shape [1] -> [2] (the checkpoint is resharded onto it)"),
        (WARN, "resume: optim.kwargs.betas (unset) -> [0.8, 0.9] (the config given is used)"),
        (WARN, "resume: optim.weight_decay 0.0 -> 0.5 (the config given is used)"),
        (WARN, "resume: sharding.param_dtype null -> bfloat16 (the config given is used)"),
        (INFO, "resume: sharding.rules[0].reshard_after_forward null -> false (the checkpoint is resharded onto it)"),
    ]
    assert config_differences(before, before) == []


def test_keys_a_checkpoint_predates_are_said_only_when_not_at_their_default():
    """A checkpoint written before a key existed (here: no `adapter` section, no rule `backend`, as
    an older composerun's manifest has them): the key at its default is no change; set otherwise,
    it is said."""
    before = to_plain(compose(*TINY))
    del before["adapter"]
    del before["sharding"]["rules"][0]["backend"]
    assert config_differences(before, to_plain(compose(*TINY))) == []
    assert config_differences(before, to_plain(compose(*TINY, "adapter.rank=4", "sharding.rules.0.backend=eager"))) == [
        (WARN, "resume: adapter.rank (unset) -> 4 (the config given is used)"),
        (INFO, "resume: sharding.rules[0].backend (unset) -> eager (the checkpoint is resharded onto it)"),
    ]


def test_a_manifest_without_a_config_is_said_and_the_same_hash_says_nothing():
    cfg = compose(*TINY, "optim.lr=3e-3")
    meta = {"config": to_plain(cfg), "config_hash": "new"}
    assert resume_lines({"config_hash": "new", "config": {}}, meta, cfg, 2) == []
    (level, line), *rest = resume_lines({"config_hash": "old"}, meta, cfg, 2)
    assert not rest and level == WARN
    assert line == (
        "resume: the checkpoint's manifest holds no config to compare (config hash old, this run's new); "
        "the config given is used"
    )


def test_a_schedule_change_states_the_lr_jump():
    """Extending a 4-step run to 8 steps: step 5 was past the old schedule's end (min_lr) and is
    early in the new decay.  Extending it by one step moves nothing: the last step trains at min_lr."""
    old = {"config": to_plain(compose(*TINY, "optim.warmup_steps=1", "train.steps=4")), "config_hash": "old"}

    def lines(steps: int) -> list[tuple[int, str]]:
        cfg = compose(*TINY, "optim.warmup_steps=1", f"train.steps={steps}")
        return resume_lines(old, {"config": to_plain(cfg), "config_hash": "new"}, cfg, 4)

    cfg = compose(*TINY, "optim.warmup_steps=1", "train.steps=8")
    new = cfg.optim.lr * lr_factor(4, 8, cfg.optim)
    assert new > 2e-4
    assert lines(8) == [
        (WARN, "resume: train.steps 4 -> 8 (the config given is used)"),
        (WARN, f"resume: the LR at step 5 changes from 0.0001 (the checkpoint's schedule) to {new:.6g}"),
    ]
    assert lines(5) == [(WARN, "resume: train.steps 4 -> 5 (the config given is used)")]
    # nothing trains (train.steps=0 loads to export or verify): no LR to speak of
    assert lines(0) == [(WARN, "resume: train.steps 4 -> 0 (the config given is used)")]


def test_another_optimizer_class_gets_its_own_constructor_values_back():
    """SGD's momentum, nesterov and weight decay as constructed; a key the constructed optimizer
    does not have goes; the state (momentum buffers) is the loaded one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    saved = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.1)
    model(torch.randn(3, 4)).sum().backward()
    saved.step()
    sd = saved.state_dict()
    sd["param_groups"][0]["initial_lr"] = 0.1  # as an LR scheduler leaves it
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    given = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    optim.load_state_dict(sd)
    assert optim.param_groups[0]["momentum"] == 0.5  # what a load alone leaves
    keep_given_hyperparameters(optim, given)
    group = optim.param_groups[0]
    assert {k: v for k, v in group.items() if k not in ("params", "lr")} == {k: v for k, v in given[0].items() if k != "lr"}
    assert group["lr"] == 0.1  # the LR its last step trained with: the schedule sets it again each step
    assert group["momentum"] == 0.9 and group["nesterov"] and group["weight_decay"] == 0
    assert "initial_lr" not in group and group["params"] == list(model.parameters())
    bufs = [optim.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(b, saved.state[p]["momentum_buffer"]) for b, p in zip(bufs, model.parameters(), strict=True))


# --- one in-process rank: the real resume path ------------------------------------------------


def set_lr_at(cfg, step: int) -> float:
    return cfg.optim.lr * lr_factor(step, 2, cfg.optim)  # the 2-step run's schedule


def test_a_resume_trains_with_the_weight_decay_given(mesh, tmp_path: Path, capsys):
    """A 2-step run with weight_decay 0.0, resumed for one step with 0.5 and with 0.0 from the
    same checkpoint.  One AdamW step decays each weight by lr * weight_decay before the Adam
    update, which is the same in both (same weights, same state, same batch), so the two
    results differ by exactly lr * 0.5 * the checkpoint's weights.  Loading the checkpoint's
    param groups (weight_decay 0.0 in both) made them equal."""
    from composerun.train.run import train as train_on
    from composerun.train.setup import set_up

    cpu = torch.device("cpu")
    train_on(compose(*TINY, "train.steps=2"), tmp_path / "a", mesh, cpu)
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000002"
    on = (*TINY, "train.steps=3", f"checkpoint.resume={ckpt}")
    given = compose(
        *on, "optim.weight_decay=0.5", "optim.kwargs.eps=1e-6", "optim.kwargs.betas=[0.8,0.95]",
        "train.seed=7", "checkpoint.every=1",  # (neither changes what is trained: not said)
    )  # fmt: skip
    capsys.readouterr()
    start = choose_start(given, tmp_path / "groups")  # the launcher's decision: ckpt
    assert start.load == ckpt and start.step == 2
    printed = capsys.readouterr().out
    assert printed == (
        f"composerun: resuming {ckpt} with a changed config: optim.kwargs.betas (unset) -> [0.8, 0.95]; "
        "optim.kwargs.eps (unset) -> 1e-06; optim.weight_decay 0.0 -> 0.5; train.steps 2 -> 3\n"
    )
    with composerun_log() as records:
        s = set_up(given, tmp_path / "groups", mesh, cpu, start)
    # the param groups as constructed from the config given; the state as saved
    group = {k: v for k, v in s.optim.param_groups[0].items() if k != "params"}
    assert (group["weight_decay"], group["eps"], group["betas"]) == (0.5, 1e-6, (0.8, 0.95))
    # every key as constructed but the LR, the one the checkpoint's last step trained with (the
    # schedule's; set again before each step)
    assert {k: v for k, v in group.items() if k != "lr"} == {k: v for k, v in s.optim.defaults.items() if k != "lr"}
    assert group["lr"] == pytest.approx(set_lr_at(given, 1))
    assert {float(st["step"]) for st in s.optim.state.values()} == {2.0}
    assert all(not st["exp_avg"].isnan().any() and st["exp_avg"].abs().sum() > 0 for st in s.optim.state.values())
    said = resume_records(records)
    assert (WARN, "resume: optim.weight_decay 0.0 -> 0.5 (the config given is used)") in said
    assert (WARN, "resume: optim.kwargs.eps (unset) -> 1e-06 (the config given is used)") in said
    assert len(said) == 4  # and betas, and train.steps: no LR line (step 3 is warmup's end either way)
    # the launcher's line and rank 0's log say the same keys (one comparison, one list of keys not compared)
    assert [line.split()[1] for _, line in said] == [c.split(" ")[0] for c in printed.split(": ", 2)[2].split("; ")]
    s.ckpt.close()

    train_on(compose(*on, "optim.weight_decay=0.5"), tmp_path / "b", mesh, cpu, start)
    train_on(compose(*on, "optim.weight_decay=0.0"), tmp_path / "c", mesh, cpu, start)
    start = final_weights(tmp_path / "a", *TINY)
    decayed, plain = final_weights(tmp_path / "b", *TINY), final_weights(tmp_path / "c", *TINY)
    lr = given.optim.lr * lr_factor(2, 3, given.optim)
    got = {k: decayed[k] - plain[k] for k in start}
    want = {k: -lr * 0.5 * start[k] for k in start}
    assert max(w.abs().max().item() for w in want.values()) > 1e-4  # the decay is well above the tolerance
    assert_close_weights(got, want, atol=1e-6, what="weight decay of the resumed step")


# --- gloo ranks, as a user runs it --------------------------------------------------------------


@pytest.mark.distributed
def test_extending_a_run_on_another_mesh_says_what_changed_and_ends_at_min_lr(run_dir: Path):
    """3 steps on 1 rank, then extended to 6 on 2: rank 0's log says each change (the mesh as
    info) and the LR's jump, rank 1's says none; every step's LR is the schedule of the run
    that trained it, and the last step of each run trains at lr * min_lr_ratio."""
    one = (*TINY, "optim.warmup_steps=1")  # the last of 3 steps decays (with 2 it ends warmup)
    first = train(run_dir, *one, "train.steps=3")
    assert first["status"] == "ok"
    rows = read_metrics(run_dir)
    cfg = compose(*one, "mesh=2", "train.steps=6")
    lo = cfg.optim.lr * cfg.optim.min_lr_ratio
    assert rows[-1]["step"] == 3 and rows[-1]["lr"] == lo
    train(run_dir, *one, "mesh=2", "train.steps=6", "checkpoint.keep=3", "launch.monitor_interval=0.2")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in rows[3:]] == [cfg.optim.lr * lr_factor(s, 6, cfg.optim) for s in (3, 4, 5)]
    assert rows[-1]["lr"] == lo
    log0 = (run_dir / "rank0.log").read_text()
    jump = cfg.optim.lr * lr_factor(3, 6, cfg.optim)
    for line in (
        "[INFO] resume: mesh.shape [1] -> [2] (the checkpoint is resharded onto it)",
        "[WARNING] resume: train.steps 3 -> 6 (the config given is used)",
        f"[WARNING] resume: the LR at step 4 changes from {lo:.6g} (the checkpoint's schedule) to {jump:.6g}",
    ):
        assert line in log0, log0[-2000:]
    assert log0.count("resume: ") == 3  # checkpoint.* and launch.* changes are not said
    assert "resume: " not in (run_dir / "rank1.log").read_text()
