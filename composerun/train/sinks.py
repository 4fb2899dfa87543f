"""The metric sinks beyond metrics.jsonl and TensorBoard: Weights & Biases and MLflow
(`metrics.sinks`), on rank 0 only.

Each sink gets every logged row (its numeric values, at the row's step) and, once, the run's
parameters: the resolved config, flattened to dotted keys, and the plan's summary (`plan.*`).
The id of the W&B or MLflow run is kept in the run directory (sinks.json), so a resumed run
goes on logging into the same W&B or MLflow run instead of starting a new one.

A sink is a view of the run, never a reason to stop it: one that cannot start (its package not
installed, no server, an unwritable store) or that fails later warns once, in one line, and
is dropped; training and metrics.jsonl go on."""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from composerun.config.schema import Config, Sink
from composerun.config.typed import to_plain
from composerun.rundir import RunDir, write_json

log = logging.getLogger("composerun")

EXTRAS = {Sink.wandb: "wandb", Sink.mlflow: "mlflow"}  # the pip extra each sink needs
PLAN_KEYS = ("model", "mesh", "policy", "world_size")  # plan.json's summary, logged as plan.<key>
MAX_PARAM = 500  # MLflow keeps a parameter's value up to 6000 characters; W&B any: a list is shortened to this


def chosen(cfg: Config) -> list[Sink]:
    """The sinks of `cfg.metrics` (jsonl always; tensorboard also when metrics.tensorboard=true)."""
    listed = list(cfg.metrics.sinks) if cfg.metrics.sinks is not None else [Sink.jsonl]
    if cfg.metrics.tensorboard and Sink.tensorboard not in listed:
        listed.append(Sink.tensorboard)
    return [Sink.jsonl, *[s for s in dict.fromkeys(listed) if s != Sink.jsonl]]


def run_params(cfg: Config, report: dict[str, Any]) -> dict[str, Any]:
    """The run's parameters: every config key by its dotted name, and the plan's summary."""
    params = _flatten(to_plain(cfg))
    params.update({f"plan.{k}": report[k] for k in PLAN_KEYS if k in report})
    return {k: v if isinstance(v, (int, float, bool, str)) or v is None else _short(v) for k, v in params.items()}


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= MAX_PARAM else text[: MAX_PARAM - 3] + "..."


class External:
    """One W&B or MLflow sink: its failures are warned of once, and it is dropped."""

    def __init__(self, kind: Sink, start: Any) -> None:
        self.kind, self.handle = kind, None
        self._guard(start)

    def _guard(self, call: Any, *args: Any) -> None:
        try:
            out = call(*args)
        except ImportError as e:
            self._drop(f"its package is not installed ({e}): pip install 'composerun[{EXTRAS[self.kind]}]'")
        except Exception as e:  # noqa: BLE001 - a sink never stops training
            first = (str(e).strip().splitlines() or [""])[0]
            self._drop(f"{type(e).__name__}: {first[:300]}")
        else:
            if self.handle is None:
                self.handle = out

    def _drop(self, why: str) -> None:
        if self.handle is not False:
            log.warning("metrics.sinks: %s failed and is dropped, training goes on: %s", self.kind, why)
        self.handle = False

    @property
    def alive(self) -> bool:
        return bool(self.handle)

    def log(self, row: dict[str, Any]) -> None:
        if self.alive:
            values = {
                k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self._guard(self.handle.log, values, row["step"])

    def close(self) -> None:
        if self.alive:
            self._guard(self.handle.close)
            self.handle = None


def open_external(cfg: Config, run_dir: Path, report: dict[str, Any]) -> list[External]:
    """The W&B and MLflow sinks `cfg` asks for, started (rank 0 only calls this)."""
    run, out = RunDir(run_dir), []
    params = run_params(cfg, report) if any(s in EXTRAS for s in chosen(cfg)) else {}
    for kind in chosen(cfg):
        if kind == Sink.wandb:
            out.append(External(kind, lambda: WandbRun(cfg, run, params)))
        elif kind == Sink.mlflow:
            out.append(External(kind, lambda: MlflowRun(cfg, run, params)))
    return out


def _saved_ids(run: RunDir) -> dict[str, str]:
    try:
        ids = json.loads(run.sink_ids.read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _save_id(run: RunDir, kind: str, run_id: str) -> None:
    ids = _saved_ids(run)
    if ids.get(kind) != run_id:
        write_json(run.sink_ids, {**ids, kind: run_id})


class WandbRun:
    """A W&B run (WANDB_MODE=offline writes it under RUN/wandb/ for `wandb sync`)."""

    def __init__(self, cfg: Config, run: RunDir, params: dict[str, Any]) -> None:
        import wandb

        m = cfg.metrics
        run_id = _saved_ids(run).get("wandb") or uuid.uuid4().hex[:8]
        self.run = wandb.init(
            project=m.wandb_project or os.environ.get("WANDB_PROJECT") or "composerun",
            entity=m.wandb_entity or os.environ.get("WANDB_ENTITY") or None,
            id=run_id,
            resume="allow",  # the same run again after a resume
            name=run.path.name,
            dir=str(run.path),
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.config.update(params, allow_val_change=True)  # a resumed run's new values (train.steps) too
        _save_id(run, "wandb", run_id)

    def log(self, values: dict[str, Any], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowRun:
    """An MLflow run through the tracking client (mlflow-skinny is enough)."""

    def __init__(self, cfg: Config, run: RunDir, params: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        m = cfg.metrics
        # default: a file store in the run directory, not MLflow's own default (a database in the cwd)
        uri = m.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run.path / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # a file store, asked for by its URI: MLflow 3 refuses one unless told it is wanted
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client, self.Metric = MlflowClient(tracking_uri=uri), Metric
        run_id = _saved_ids(run).get("mlflow")
        if run_id is None:
            name = m.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "composerun"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment, run_name=run.path.name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        _save_id(run, "mlflow", run_id)
        # a parameter cannot change in MLflow: a resumed run adds the keys it lacks (the first value stays)
        have = self.client.get_run(run_id).data.params
        new = [Param(k, str(v)) for k, v in params.items() if k not in have]
        for i in range(0, len(new), 100):  # MLflow's batch limit
            self.client.log_batch(run_id, params=new[i : i + 100])

    def log(self, values: dict[str, Any], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, float(v), now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
