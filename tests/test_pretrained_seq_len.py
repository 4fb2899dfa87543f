"""A pretrained model made for sequences shorter than the model option's default (llama3's
2048): its default sequence length is its own max_position_embeddings, an explicit longer
data.seq_len is refused in one line, and a run that trains nothing (train.steps=0: load, then
export) checks no sequence length at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, compose_node

from composerun.config import Config, to_typed
from composerun.config import validate as validate_config
from composerun.data import build_data, check_seq_len
from composerun.errors import ConfigError
from composerun.models.hf import apply_pretrained

transformers = pytest.importorskip("transformers")
from test_hf_export import tiny_pretrained  # noqa: E402 - needs transformers

MAX_POSITIONS = 128  # tiny_pretrained's max_position_embeddings


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("short") / "pretrained"
    tiny_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["max_position_embeddings"] == MAX_POSITIONS
    return directory


def ranks_config(source: Path, *overrides: str) -> Config:
    """What the ranks get (the launcher fills the dimensions from config.json: launch/job.py)."""
    node = compose_node("+model=llama3", f"model.pretrained={source}", *overrides, validate=False)
    apply_pretrained(node)
    validate_config(node)
    return to_typed(node)


def test_the_default_sequence_length_is_the_models_own(source: Path) -> None:
    cfg = ranks_config(source, "data=tokens")
    assert cfg.model.seq_len == MAX_POSITIONS and cfg.model.kwargs["max_seq_len"] == MAX_POSITIONS
    check_seq_len(cfg)
    assert build_data(cfg).seq_len == MAX_POSITIONS
    shorter = ranks_config(source, "model.seq_len=32")  # one that fits stays as given
    assert shorter.model.seq_len == 32


def test_an_explicit_longer_sequence_is_refused_where_it_trains(source: Path) -> None:
    with pytest.raises(ConfigError) as e:
        check_seq_len(ranks_config(source, "data.seq_len=256"))
    assert str(e.value) == (
        f"data.seq_len=256 is larger than the model's max_seq_len={MAX_POSITIONS} (model.kwargs.max_seq_len): "
        f"shorten data.seq_len (max_position_embeddings in {source}/config.json)"
    )
    check_seq_len(ranks_config(source, "data.seq_len=256", "train.steps=0"))  # nothing trains: nothing checked


@pytest.mark.e2e
def test_a_pretrained_model_of_short_sequences_exports_without_training(source: Path, tmp_path: Path) -> None:
    """Issue 29's command: `+model=llama3 model.pretrained=DIR train.steps=0 checkpoint.export=hf`
    on a directory with max_position_embeddings 128; and a training run asking for 256
    tokens is one line, exit 2."""
    r = cli("+model=llama3", f"model.pretrained={source}", "train.steps=0", "checkpoint.export=hf",
            "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    config = json.loads((tmp_path / "run" / "export" / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == MAX_POSITIONS
    r = cli("+model=llama3", f"model.pretrained={source}", "data.seq_len=256", "hydra.run.dir=long", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("composerun: error: data.seq_len=256 is larger"), lines
    assert "Traceback" not in r.stderr + r.stdout
