"""Checks of a composed config that need several fields at once, or the config groups on
disk; `validate()` runs once right after composition, before any process group or rank exists.
A mistake is a ConfigError: one line naming the key and the fix."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from composerun.config.elastic import check_node_range, elastic_dim, node_range
from composerun.config.schema import MeshConfig, byte_size, dp_size_of, mesh_dim_names, world_size_of
from composerun.config.typed import config_key
from composerun.errors import ConfigError

MESH_RE = re.compile(r"^\d+(x\d+)*$")


def world_size(cfg: DictConfig) -> int:
    return world_size_of(cfg.mesh.shape)


def shipped_options(group: str) -> list[str]:
    """The options composerun ships for a config group (user config dirs may add more)."""
    from importlib.resources import files

    names = [p.name[:-5] for p in (files("composerun.configs") / group).iterdir() if p.name.endswith(".yaml")]
    return sorted(n for n in names if not n.startswith("_"))  # _schema is the group's schema


def register_mesh_shapes(values: list[str]) -> None:
    """`mesh=3x2`, `mesh=8x64`: any shape spelt like the shipped options becomes a mesh
    option of that shape (a shipped file of the same name keeps its own settings)."""
    shipped = set(shipped_options("mesh"))
    for v in values:
        v = v.strip("'\"")
        if MESH_RE.match(v) and v not in shipped:
            ConfigStore.instance().store(group="mesh", name=v, node=MeshConfig(shape=[int(n) for n in v.split("x")]))


def key_hint(kind: Any, key: str, prefix: str) -> str:
    """What to say after `PREFIX.KEY: no such key` for a key that the schema `kind` (a
    dataclass) lacks: the nearest real key, or where a constructor argument goes, or the keys
    there are; "" when `kind` is no schema."""
    import dataclasses
    import difflib

    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return ""
    known = {config_key(f.name) for f in dataclasses.fields(kind)}  # checkpoint.async, not async_
    near = difflib.get_close_matches(str(key), sorted(known), n=1)
    if near:
        return f"; did you mean {prefix}{near[0]}?"
    if "kwargs" in known:
        return f"; a constructor argument goes under {prefix}kwargs: +{prefix}kwargs.{key}=..."
    return f"; {prefix.rstrip('.') or 'the config'} has: {', '.join(sorted(known))}"


def unknown_key(node: DictConfig, prefix: str = "") -> str | None:
    """The first key of `node` (recursively, through its typed sections and lists of them) that
    its schema does not have, as one line with the nearest real key; None when all are known.
    A misspelt key fails while Hydra composes, but `+train.stepz=2` adds one, and nothing reads it."""
    import dataclasses

    kind = OmegaConf.get_type(node)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return None  # a plain dict (model.kwargs, optim.kwargs): any key
    known = {config_key(f.name) for f in dataclasses.fields(kind)}  # checkpoint.async, not async_
    for key, value in node.items_ex(resolve=False):
        if key not in known:
            where = prefix.rstrip(".") or "the config"
            return f"{prefix}{key}: no such key in {where}{key_hint(kind, str(key), prefix)}"
        if node.get(key) is None:  # a null section or list: nothing in it
            found = None
        elif isinstance(value, DictConfig):
            found = unknown_key(value, f"{prefix}{key}.")
        elif isinstance(value, ListConfig):
            found = next(
                (
                    u
                    for i, v in enumerate(value)
                    if isinstance(v, DictConfig) and (u := unknown_key(v, f"{prefix}{key}.{i}."))
                ),
                None,
            )
        else:
            found = None
        if found:
            return found
    return None


def unresolvable(node: DictConfig | ListConfig, prefix: str = "") -> str | None:
    """The first value of `node` (recursively) whose interpolation cannot be resolved
    (`train.steps=${nosuch}`), as one line naming its key; None when every one resolves.
    OmegaConf resolves lazily, so without this the first reader of the key fails, wherever it is."""
    from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        if OmegaConf.is_missing(node, key):
            continue
        try:
            value = node[key]
        except InterpolationResolutionError as e:
            inner: BaseException | None = e
            while inner is not None:  # composerun's own check inside a resolver: its line
                if isinstance(inner, ConfigError):
                    raise inner from None
                inner = inner.__cause__ or inner.__context__
            raw = node._get_node(key)._value()  # the value as typed: ${nosuch}
            msg = str(e).splitlines()[0]
            if isinstance(e, InterpolationKeyError):
                msg += " (an interpolation names another key of the config: composerun --cfg job lists them)"
            return f"{prefix}{key}={raw}: {msg}"
        if isinstance(value, (DictConfig, ListConfig)):
            found = unresolvable(value, f"{prefix}{key}.")
            if found:
                return found
    return None


def validate(cfg: DictConfig, model_options: list[str] | None = None) -> None:
    """Raise ConfigError with one line naming the key and the fix."""
    if OmegaConf.is_missing(cfg, "model"):
        options = model_options if model_options is not None else shipped_options("model")
        raise ConfigError("no model chosen: add +model=NAME, one of: " + ", ".join(sorted(options)))
    bad = unresolvable(cfg)
    if bad:
        raise ConfigError(bad)
    unknown = unknown_key(cfg)
    if unknown:
        raise ConfigError(unknown)
    if OmegaConf.is_missing(cfg.model, "_target_"):
        raise ConfigError("model._target_ is not set: name the nn.Module class to build")

    for key in ("dim", "vocab_size", "fusion_vocab_size", "n_layers", "n_heads", "in_dim", "out_dim", "seq_len"):
        value = cfg.model.get(key)
        if value is not None and value < 1:
            raise ConfigError(f"model.{key}={value}: must be a positive number")

    _check_mesh(cfg)

    for i, rule in enumerate(cfg.sharding.rules):
        if "api" not in rule or OmegaConf.is_missing(rule, "api"):
            raise ConfigError(
                f"sharding.rules.{i}: no api; give api: fully_shard, replicate, checkpoint, compile, float8 or "
                f"parallelize (e.g. sharding.rules.{i}.api=fully_shard)"
            )

    t = cfg.train
    if t.steps < 0:
        raise ConfigError(f"train.steps={t.steps}: must be 0 (load, then export or verify, without training) or more")
    if t.grad_accum < 1:
        raise ConfigError(f"train.grad_accum={t.grad_accum}: must be at least 1")
    if t.log_every is not None and t.log_every < 1:
        raise ConfigError(f"train.log_every={t.log_every}: must be at least 1")
    _check_loader(cfg.data)
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr={cfg.optim.lr}: must be a positive number")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps}: must be 0 or more")
    if not cfg.optim.grad_clip >= 0 or not math.isfinite(cfg.optim.grad_clip):
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip}: must be 0 (no clipping) or a positive max norm")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio}: must be between 0 and 1 (a fraction of optim.lr)"
        )
    if not cfg.launch.monitor_interval > 0 or not math.isfinite(cfg.launch.monitor_interval):
        raise ConfigError(
            f"launch.monitor_interval={cfg.launch.monitor_interval}: must be a positive number of seconds"
        )

    ws, dp = world_size(cfg), dp_size_of(list(cfg.mesh.shape), cfg.mesh.dim_names)
    per = dp * t.grad_accum
    # A plan trains nothing: the batch (sized for this machine) need not fit the planned mesh.
    fits = cfg.data.batch_size % per == 0 or cfg.plan.enabled
    if cfg.data.batch_size < 1 or not fits:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} must be a positive multiple of "
            f"{dp} data-parallel ranks x {t.grad_accum} micro-batches = {per}"
        )

    _check_plan(cfg.plan)
    _check_profile(cfg.profile, t.steps)
    _check_launch(cfg.launch, ws)
    _check_node_range(cfg)
    _check_adapter(cfg)

    ck = cfg.checkpoint
    try:
        byte_size(ck.export_max_shard_size)
    except ValueError as e:
        raise ConfigError(f"checkpoint.export_max_shard_size={e}") from None
    if ck.every < 0:
        raise ConfigError(f"checkpoint.every={ck.every}: must be 0 (only at the end) or a step interval")
    if ck.keep < 1:
        raise ConfigError(f"checkpoint.keep={ck.keep}: keep at least 1 checkpoint")
    if ck.resume not in ("auto", "never") and not Path(ck.resume).is_dir():
        raise ConfigError(
            f"checkpoint.resume={ck.resume}: no such checkpoint directory; use auto, never, a checkpoint "
            "(RUN_DIR/checkpoints/step-N) or a run directory"
        )
    if cfg.data.path is not None and not Path(cfg.data.path).is_file() and not str(cfg.data._target_).endswith(("TokenData", "SFTData")):
        raise ConfigError(f"data.path={cfg.data.path}: no such file; name a local text file")  # (token data: its own check)
    if ck.init_from is not None and Path(ck.init_from).is_dir():
        raise ConfigError(
            f"checkpoint.init_from={ck.init_from}: a directory; init_from takes a .safetensors file, "
            "a model.safetensors.index.json or a torch file of tensors (checkpoint.resume takes a checkpoint folder)"
        )
    if ck.init_from is not None and not Path(ck.init_from).is_file():
        raise ConfigError(f"checkpoint.init_from={ck.init_from}: no such file")


def _check_adapter(cfg: DictConfig) -> None:
    """adapter.*'s values; which linears the targets select is checked on the model (models/lora.py)."""
    a = cfg.adapter
    if str(a.name) == "none":
        if str(cfg.checkpoint.export) == "peft":
            raise ConfigError("checkpoint.export=peft: the run has no adapter to export; add adapter=lora (or export hf/safetensors)")
        return
    if a.rank < 1:
        raise ConfigError(f"adapter.rank={a.rank}: must be at least 1 (the adapters' inner dimension)")
    if not a.alpha > 0 or not math.isfinite(a.alpha):
        raise ConfigError(f"adapter.alpha={a.alpha}: must be a positive number (the adapters' output is scaled by alpha / rank)")
    if not 0 <= a.dropout < 1:
        raise ConfigError(f"adapter.dropout={a.dropout}: must be at least 0 and below 1")
    if not a.targets:
        raise ConfigError("adapter.targets=[]: name the linears that get an adapter (FQN globs, as in sharding rules)")


def _check_mesh(cfg: DictConfig) -> None:
    """mesh.shape and its dims' names, which a policy may give (sharding.mesh_dim_names)."""
    shape = list(cfg.mesh.shape)
    if not shape or any(n < 1 for n in shape):
        raise ConfigError(
            f"mesh.shape={shape}: every dimension must be a positive number of ranks, e.g. mesh.shape=[2,4]"
        )
    policy_names = cfg.sharding.get("mesh_dim_names")
    if cfg.mesh.dim_names is None and policy_names and len(policy_names) == len(shape):
        # the policy names the mesh's dims (fsdp_tp: [shard, tp]); a mesh of another rank is
        # left to the policy's checks, which say which mesh it needs (parallel/rule_checks.py)
        cfg.mesh.dim_names = list(policy_names)
    names = mesh_dim_names(shape, cfg.mesh.dim_names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ConfigError(f"mesh.dim_names={names} must name each of the {len(shape)} dims of mesh.shape={shape} once")
    if cfg.mesh.elastic:
        elastic_dim(shape, cfg.mesh.dim_names, cfg.mesh.elastic_dim)
    elif cfg.mesh.elastic_dim is not None:
        raise ConfigError(
            f"mesh.elastic_dim={cfg.mesh.elastic_dim} does nothing without mesh.elastic=true: add it, or leave elastic_dim out"
        )


def _check_launch(launch: DictConfig, ws: int) -> None:
    if launch.nodes < 1 or ws % launch.nodes:
        raise ConfigError(f"launch.nodes={launch.nodes}: must split the mesh's {ws} ranks evenly over the nodes")
    if launch.shutdown_timeout is not None and launch.shutdown_timeout < 0:
        raise ConfigError(f"launch.shutdown_timeout={launch.shutdown_timeout}: must be 0 or more seconds")
    if not launch.collective_timeout > 0:
        raise ConfigError(
            f"launch.collective_timeout={launch.collective_timeout}: must be more than 0 seconds (default 600)"
        )
    if launch.omp_threads is not None and launch.omp_threads < 1:  # (a rank would fail to set it)
        raise ConfigError(
            f"launch.omp_threads={launch.omp_threads}: must be 1 or more threads a rank "
            "(leave it out: the machine's cores / the local ranks)"
        )


# The integer settings of torch's c10d rendezvous (torchrun's --rdzv-conf) a run may give.
RDZV_CONF = [
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
    "keep_alive_max_attempt", "read_timeout", "timeout",
]  # fmt: skip


def _check_node_range(cfg: DictConfig) -> None:
    """launch.min_nodes (an elastic SLURM run): a range of 1 <= min_nodes <= nodes, on a mesh
    whose elastic rule takes every world of the range (config/elastic.py)."""
    launch = cfg.launch
    if launch.max_restarts is not None and launch.max_restarts < 0:
        raise ConfigError(f"launch.max_restarts={launch.max_restarts}: must be 0 or more restarts")
    for key, value in launch.rdzv_conf.items():
        if key not in RDZV_CONF:  # torch ignores a name it does not read
            raise ConfigError(f"launch.rdzv_conf.{key}: not a setting of torch's rendezvous; one of {RDZV_CONF}")
        if value < 0:
            raise ConfigError(f"launch.rdzv_conf.{key}={value}: must be 0 or more")
    span = node_range(launch.nodes, launch.min_nodes, cfg.mesh.elastic)
    if span is None:
        return
    low, high = span
    shape, t = list(cfg.mesh.shape), cfg.train
    check_node_range(shape, cfg.mesh.dim_names, cfg.mesh.elastic_dim, t.grad_accum, cfg.data.batch_size, low, high)


def _check_plan(plan: DictConfig) -> None:
    """plan.* (composerun/parallel/estimate.py)."""
    from composerun.devices import plan_device

    for key in ("memory_gib", "link_gbps", "internode_gbps"):
        value = plan.get(key)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"plan.{key}={value}: must be a positive number")
    if plan.gpus_per_node < 1:
        raise ConfigError(f"plan.gpus_per_node={plan.gpus_per_node}: must be 1 or more (the GPUs of one node)")
    device = plan.get("device")  # a name, or a map of figures (devices.plan_device)
    if isinstance(device, DictConfig | ListConfig):
        device = OmegaConf.to_container(device, resolve=True)
    if device is not None:
        plan_device(device)


def _check_profile(profile: DictConfig, steps: int) -> None:
    """profile.steps: [A, B], the first and the last step traced, 1 <= A <= B <= train.steps;
    profile.flight_recorder: 0 or more entries."""
    if profile.flight_recorder < 0:
        raise ConfigError(
            f"profile.flight_recorder={profile.flight_recorder}: the collectives to keep per rank, 0 (off) or more"
        )
    span = profile.steps
    if span is None:
        return
    span = list(span)
    shown = ",".join(map(str, span))
    if len(span) != 2 or not 1 <= span[0] <= span[1] <= steps:
        raise ConfigError(
            f"profile.steps=[{shown}]: give [A,B], the first and last step to trace, with 1 <= A <= B <= "
            f"train.steps ({steps}): e.g. profile.steps=[{min(2, max(steps, 1))},{min(3, max(steps, 1))}]"
        )


def _check_loader(data: DictConfig) -> None:
    """data.prefetch and data.workers (composerun/data/loader.py)."""
    if data.prefetch < 0:
        raise ConfigError(f"data.prefetch={data.prefetch}: must be 0 (make each batch in its step) or more")
    if data.workers is not None and data.workers < 0:
        raise ConfigError(f"data.workers={data.workers}: must be 0 (batches made in the rank) or more")
    if data.workers and not data.prefetch:
        raise ConfigError(
            f"data.workers={data.workers} with data.prefetch=0: worker processes make batches ahead; "
            "set data.workers=0 to make each batch in its step, or data.prefetch=1 or more"
        )
