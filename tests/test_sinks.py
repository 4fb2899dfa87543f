"""End-to-end: metrics.sinks=[wandb,mlflow], offline (W&B's offline mode, MLflow's file store).

A 2-rank run and its resume (more steps) in one run directory log into one W&B run and one
MLflow run; what each holds is read back with the tools' own readers (MLflow's client; W&B's
protobuf records of its offline transaction log) and set beside metrics.jsonl and the resolved
config (.hydra/config.yaml), not beside composerun's own code.  A sink that cannot start warns
once and the run goes on."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from conftest import cli, read_metrics, train
from omegaconf import OmegaConf

ARGS = (
    "+model=unit",
    "model.dim=8",
    "mesh=2",
    "checkpoint.every=3",
    "metrics.sinks=[wandb,mlflow]",
    "hydra.run.dir=run",
)


def flat_config(run: Path) -> dict[str, Any]:
    """The scalar keys of the resolved config the run wrote, by dotted name."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        elif not isinstance(node, list):
            out[prefix] = node

    walk(OmegaConf.to_container(OmegaConf.load(run / ".hydra" / "config.yaml")), "")
    return out


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B transaction log (run-ID.wandb): a 7-byte header, then
    LevelDB's log format (32 KiB blocks of records, each with a 7-byte header: crc, length, type;
    types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, records, off, part = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B", path
    while off + 7 <= len(data):
        left = 32768 - off % 32768
        if left < 7:  # the rest of a block too short for a header is padding
            off += left
            continue
        _, n, kind = struct.unpack("<IHB", data[off : off + 7])
        if n == 0 and kind == 0:
            break
        part += data[off + 7 : off + 7 + n]
        off += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def wandb_logged(run: Path) -> tuple[set[str], dict[int, dict[str, float]], list[dict[str, Any]]]:
    """((run id, project) of every run record, {step: values} over every offline run folder, each
    folder's config)."""
    ids, history, configs = set(), {}, []
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add((r.run.run_id, r.run.project))
                configs.append({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":  # a later config update of this folder's run
                configs[-1].update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                items = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                step = items.pop("_step")
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return ids, history, configs


def numeric(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.e2e
def test_wandb_and_mlflow_hold_a_run_and_its_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()  # a file store outside the run directory, by env var
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": store, "WANDB_PROJECT": "sinks-test"}
    r = cli(*ARGS, "train.steps=3", cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "run"
    first_config = flat_config(run)
    r = cli(*ARGS, "train.steps=5", cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "metrics.sinks" not in r.stdout + r.stderr  # no sink warned
    rows = {row["step"]: numeric(row) for row in read_metrics(run)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    config = flat_config(run)
    assert config["train.steps"] == 5 and first_config["train.steps"] == 3

    # W&B: one run id over both runs; every row of metrics.jsonl at its step; the config
    ids, history, configs = wandb_logged(run)
    assert len(ids) == 1 and len(configs) == 2, (ids, len(configs))
    assert [project for _, project in ids] == ["sinks-test"]  # $WANDB_PROJECT
    assert history == rows
    for got, want in zip(configs, (first_config, config), strict=True):
        assert {k: got.get(k) for k in want} == want
        assert got["plan.mesh"] == "2" and got["plan.world_size"] == 2

    # MLflow: one run in the store, its metric histories are metrics.jsonl's, its params the config
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when told
    client = MlflowClient(tracking_uri=store)
    [experiment] = [e for e in client.search_experiments() if e.name == "composerun"]
    [logged] = client.search_runs([experiment.experiment_id])
    assert logged.info.status == "FINISHED"
    for key in ("loss", "grad_norm", "lr", "step_s"):
        got = {m.step: m.value for m in client.get_metric_history(logged.info.run_id, key)}
        assert got == {s: row[key] for s, row in rows.items()}, key
    params = logged.data.params
    # a parameter cannot change in MLflow: the resume keeps the first run's values (train.steps=3)
    assert {k: params.get(k) for k in first_config} == {k: str(v) for k, v in first_config.items()}
    assert params["plan.policy"] == "fsdp"


@pytest.mark.distributed
def test_a_failing_sink_warns_once_and_the_run_finishes(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """An MLflow store that cannot be written (under a file): one warning line, every row logged
    (one rank, in this process)."""
    pytest.importorskip("mlflow")
    (tmp_path / "afile").write_text("not a folder")
    uri = (tmp_path / "afile" / "mlruns").as_uri()
    summary = train(tmp_path / "run", "+model=unit", "model.dim=8", "train.steps=3", "metrics.sinks=[mlflow]",
                    f"metrics.mlflow_uri={uri}")  # fmt: skip
    assert summary["status"] == "ok" and summary["steps"] == 3
    out = capfd.readouterr()
    warned = [line for line in (out.out + out.err).splitlines() if "metrics.sinks" in line]
    assert len(warned) == 1 and warned[0].startswith("metrics.sinks: mlflow failed and is dropped, training goes on: ")
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_a_sink_that_fails_later_warns_once_and_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink that starts, logs a row, then fails on every call: one warning, no call after it."""
    from composerun.config.schema import Sink
    from composerun.train import sinks

    warned: list[str] = []
    monkeypatch.setattr(sinks.log, "warning", lambda fmt, *args: warned.append(fmt % args))

    class Flaky:
        def __init__(self) -> None:
            self.logged: list[int] = []

        def log(self, values: dict[str, float], step: int) -> None:
            if step > 1:
                raise ConnectionError("server unreachable\nretry later")
            self.logged.append(step)

        def close(self) -> None:
            raise AssertionError("a dropped sink is not closed")

    handle = Flaky()
    sink = sinks.External(Sink.mlflow, lambda: handle)
    for step in (1, 2, 3, 4):
        sink.log({"step": step, "loss": 1.0 / step, "memory_tracked": True})
    sink.close()
    assert handle.logged == [1]
    assert warned == [
        "metrics.sinks: mlflow failed and is dropped, training goes on: ConnectionError: server unreachable"
    ]
    missing = sinks.External(Sink.wandb, lambda: __import__("no_such_wandb_module"))
    assert not missing.alive and "pip install 'composerun[wandb]'" in warned[-1]
