"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group under configs/ extends the matching schema here, so a misspelt key, a wrong
type or a choice outside an Enum fails while Hydra composes, naming the key.  Checks
that need several fields at once live in `validate()`, which runs once right after
composition and before any process group or rank exists.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, BooleanNode, DictConfig, OmegaConf

from composerun.errors import ConfigError


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Backend(Enum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Api(Enum):
    fully_shard = "fully_shard"
    replicate = "replicate"
    checkpoint = "checkpoint"


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Task(Enum):
    regression = "regression"  # dense features in, dense targets out, MSE
    tokens = "tokens"  # token ids in, next-token logits out, cross-entropy


class Schedule(Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class Export(Enum):
    none = "none"
    safetensors = "safetensors"


class StartMethod(Enum):
    spawn = "spawn"
    fork = "fork"
    forkserver = "forkserver"


@dataclass
class ModelConfig:
    # Any nn.Module class; it is called with the non-null constructor keys below plus `kwargs`.
    _target_: str = MISSING
    name: str = ""
    dim: Optional[int] = None
    vocab_size: Optional[int] = None
    fusion_vocab_size: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # What the data looks like: features of in_dim -> out_dim, or token ids.
    task: Task = Task.regression
    in_dim: Optional[int] = None
    out_dim: Optional[int] = None
    seq_len: int = 16


@dataclass
class MeshConfig:
    shape: List[int] = field(default_factory=lambda: [1])
    dim_names: Optional[List[str]] = None  # default: [shard] for 1-D, [replicate, shard] for 2-D
    device: Device = Device.auto
    backend: Backend = Backend.auto


@dataclass
class RuleConfig:
    # Select modules by FQN glob (`*` one name, `**` any depth, `<root>` the model itself)
    # and/or by class name; both given means both must hold.
    match: Optional[str] = None
    class_name: Optional[str] = None
    api: Api = MISSING
    # Mesh dims the API runs over: null = every rank as one data-parallel dim,
    # [replicate, shard] = HSDP on a 2-D mesh.
    mesh_dims: Optional[List[str]] = None
    reshard_after_forward: Optional[bool] = None
    param_dtype: Optional[DType] = None
    reduce_dtype: Optional[DType] = None
    offload: bool = False


@dataclass
class ShardingConfig:
    name: str = ""
    rules: List[RuleConfig] = field(default_factory=list)
    # Every parameter must end up inside some unit of a data-parallel API.
    require_coverage: bool = True


@dataclass
class OptimConfig:
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.0
    kwargs: Dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 0
    schedule: Schedule = Schedule.cosine
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 turns clipping off; the norm is logged either way


@dataclass
class DataConfig:
    _target_: str = "composerun.data.SyntheticData"
    batch_size: int = 8  # global: split evenly over the data-parallel ranks
    seed: int = 1234
    path: Optional[str] = None


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end
    at_end: bool = True
    keep: int = 2
    resume: str = "auto"  # auto | never | PATH
    export: Export = Export.none
    init_from: Optional[str] = None
    verify: bool = False
    # `async` (a Python keyword) is added as a typed node in _with_async() below.


@dataclass
class TrainConfig:
    steps: int = 20
    seed: int = 0
    grad_accum: int = 1
    log_every: int = 1
    deterministic: bool = True


@dataclass
class MetricsConfig:
    tensorboard: bool = False
    progress: bool = True  # a tqdm bar on rank 0, silent when stderr is not a terminal


@dataclass
class LaunchConfig:
    start_method: StartMethod = StartMethod.spawn
    monitor_interval: float = 0.1
    omp_threads: Optional[int] = None  # default: cores / local ranks


@dataclass
class Config:
    model: ModelConfig = MISSING
    mesh: MeshConfig = field(default_factory=MeshConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def _with_async(node: DictConfig) -> DictConfig:
    """The CLI contract names `checkpoint.async`, which no dataclass field can be called;
    add it as a typed bool node so it is validated like every other key."""
    OmegaConf.set_struct(node, False)
    node["async"] = BooleanNode(False)
    OmegaConf.set_struct(node, True)
    return node


def register() -> None:
    cs = ConfigStore.instance()
    root = OmegaConf.structured(Config)
    _with_async(root.checkpoint)
    cs.store(name="composerun_schema", node=root)
    for group, schema in [
        ("model", ModelConfig),
        ("mesh", MeshConfig),
        ("sharding", ShardingConfig),
        ("optim", OptimConfig),
        ("data", DataConfig),
        ("train", TrainConfig),
    ]:
        cs.store(group=group, name="_schema", node=schema)
    cs.store(group="checkpoint", name="_schema", node=_with_async(OmegaConf.structured(CheckpointConfig)))


# --- cross-field checks, run once after composition -------------------------------------

MESH_RE = re.compile(r"^\d+(x\d+)*$")


def mesh_dim_names(shape: List[int], names: Optional[List[str]]) -> List[str]:
    if names:
        return list(names)
    if len(shape) == 1:
        return ["shard"]
    if len(shape) == 2:
        return ["replicate", "shard"]
    return [f"dim{i}" for i in range(len(shape))]


def world_size(cfg: DictConfig) -> int:
    return math.prod(cfg.mesh.shape)


def validate(cfg: DictConfig, model_options: List[str] = ()) -> None:
    """Raise ConfigError with one line naming the key and the fix."""
    if OmegaConf.is_missing(cfg, "model"):
        raise ConfigError(
            "no model chosen: add +model=NAME, one of: " + ", ".join(sorted(model_options))
        )
    if OmegaConf.is_missing(cfg.model, "_target_"):
        raise ConfigError("model._target_ is not set: name the nn.Module class to build")

    shape = list(cfg.mesh.shape)
    if not shape or any(n < 1 for n in shape):
        raise ConfigError(
            f"mesh.shape={shape}: every dimension must be a positive number of ranks, e.g. mesh.shape=[2,4]"
        )
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ConfigError(
            f"mesh.dim_names={names} must name each of the {len(shape)} dims of mesh.shape={shape} once"
        )

    t = cfg.train
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps}: must be at least 1")
    if t.grad_accum < 1:
        raise ConfigError(f"train.grad_accum={t.grad_accum}: must be at least 1")
    if t.log_every < 1:
        raise ConfigError(f"train.log_every={t.log_every}: must be at least 1")
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr={cfg.optim.lr}: must be a positive number")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps}: must be 0 or more")

    ws = world_size(cfg)
    per = ws * t.grad_accum
    if cfg.data.batch_size < 1 or cfg.data.batch_size % per:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} must be a positive multiple of "
            f"{ws} data-parallel ranks x {t.grad_accum} micro-batches = {per}"
        )

    ck = cfg.checkpoint
    if ck.every < 0:
        raise ConfigError(f"checkpoint.every={ck.every}: must be 0 (only at the end) or a step interval")
    if ck.keep < 1:
        raise ConfigError(f"checkpoint.keep={ck.keep}: keep at least 1 checkpoint")
    if ck.resume not in ("auto", "never") and not Path(ck.resume).exists():
        raise ConfigError(
            f"checkpoint.resume={ck.resume}: no such checkpoint; use auto, never or an existing path"
        )
    if ck.init_from is not None and not Path(ck.init_from).is_file():
        raise ConfigError(f"checkpoint.init_from={ck.init_from}: no such file")
