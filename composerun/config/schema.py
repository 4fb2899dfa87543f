"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group under composerun/configs/ extends the matching schema here, so a misspelt key, a wrong
type or a choice outside an Enum fails while Hydra composes, naming the key.  Checks
that need several fields at once live in `validate()`, which runs once right after
composition and before any process group or rank exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, BooleanNode, DictConfig, OmegaConf

from composerun.config.choices import (  # noqa: F401 - re-exported: composerun.config.schema's names since its start
    Adapter,
    Api,
    Backend,
    Checksum,
    Choice,
    CompileFallback,
    Device,
    DType,
    Export,
    MemorySnapshot,
    Schedule,
    Sink,
    StartMethod,
    Task,
    TokenDType,
)
from composerun.config.slurm_request import register as register_slurm
from composerun.config.values import (  # noqa: F401 - re-exported: composerun.config.schema's names since its start
    NON_DATA_PARALLEL_DIMS,
    byte_size,
    dp_size_of,
    mesh_dim_names,
    micro_batch_of,
    ranks_per_node,
    target_class,
    world_size_of,
)


@dataclass
class ModelConfig:
    # Any nn.Module class; it is called with the non-null constructor keys below plus `kwargs`.
    _target_: str = MISSING
    name: str = ""
    dim: int | None = None
    vocab_size: int | None = None
    fusion_vocab_size: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # What the data looks like: features of in_dim -> out_dim, or token ids.
    task: Task = Task.regression
    in_dim: int | None = None
    out_dim: int | None = None
    seq_len: int = 16
    # A Hugging Face directory (`+model=llama3` or `hf`): config.json gives the dimensions, its files the weights
    pretrained: str | None = None
    trust_remote_code: bool = False  # +model=hf: run the code config.json names (auto_map); off: refused
    verify_pretrained: bool = True  # +model=hf: the loaded model's forward is transformers' (one probe), or stop


@dataclass
class MeshConfig:
    shape: list[int] = field(default_factory=lambda: [1])
    dim_names: list[str] | None = None  # default: [shard] for 1-D, [replicate, shard] for 2-D
    device: Device = Device.auto
    backend: Backend = Backend.auto
    # Under torchrun, a world of another size than shape's product (a node lost, or back) runs on
    # the mesh whose `elastic_dim` takes the difference, with train.grad_accum scaled so that the
    # global batch and every micro-batch stay as they are (config/elastic.py); false: refused.
    elastic: bool = False
    elastic_dim: str | None = None  # null: the outermost data-parallel dim


@dataclass
class RuleConfig:
    # Select modules by FQN glob (`*` one name, `**` any depth, `{a,b}` either name, `<root>` the
    # model itself) and/or by class name; both given means both must hold.
    match: str | None = None
    class_name: str | None = None
    api: Api = MISSING
    # Mesh dims the API runs over: null = every rank as one data-parallel dim, [replicate, shard] = HSDP on a 2-D mesh.
    mesh_dims: list[str] | None = None
    reshard_after_forward: bool | None = None
    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    offload: bool = False
    # Only every k-th matched module, counting from the first (activation checkpointing
    # on every 2nd block: every=2).
    every: int = 1
    # checkpoint: full (every activation recomputed), selective (the outputs of `save_ops` kept,
    # the rest recomputed) or budget (the compiler keeps what fits memory_budget; needs compile).
    # compile: torch.compile's mode (default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs).
    mode: str | None = None
    # checkpoint, mode selective: the ops whose outputs are saved (null: matmuls and attention)
    save_ops: list[str] | None = None
    # checkpoint, mode selective: of the matrix products among save_ops, keep only every k-th of
    # a forward (the 1st, the k+1-th, ...) and recompute the others (torchtitan's op policy: 2)
    save_mm_every: int = 1
    # checkpoint, mode budget: the fraction of activation memory the compiler may keep, 0..1
    memory_budget: float | None = None
    # compile: torch.compile's fullgraph, dynamic, backend and backend options
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    compile_options: Any = None  # (a map; typed Any so that the command line can give one whole)
    # parallelize: {submodule FQN glob: style}; a style is colwise, rowwise, sequence, or a dict
    # {style: colwise|rowwise|sequence|prepare_input|prepare_output, input_layouts, output_layouts,
    # desired_input_layouts, desired_output_layouts, use_local_output} with layouts such as
    # replicate, shard(1) (torch's parallelize_module); null: the module's own `tp_plan()` (+model=hf:
    # transformers' plan).  (Any: the command line can give a map whole: sharding.rules.0.styles={q_proj: colwise})
    styles: Any = None
    # parallelize: the module's output is the loss's logits sharded over the vocabulary (loss parallel)
    loss_parallel: bool = False
    # float8: all-gather float8 weights where fully_shard holds the module (null: whenever it does)
    float8_all_gather: bool | None = None


@dataclass
class ShardingConfig:
    name: str = ""
    rules: list[RuleConfig] = field(default_factory=list)
    # Every parameter must end up inside some unit of a data-parallel API.
    require_coverage: bool = True
    # Mixed precision for every fully_shard/replicate rule that sets none itself; with bf16/fp16
    # parameters and no reduce_dtype anywhere, gradients are reduced in float32.
    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    # FSDP's runtime switches, set on the sharded modules after the plan is applied:
    # all-gather the next N units during forward / the previous N during backward
    # (0: FSDP's own implicit prefetching), and whether parameters are resharded after
    # backward (false keeps them unsharded between the micro-batches of train.grad_accum).
    prefetch_forward: int = 0
    prefetch_backward: int = 0
    reshard_after_backward: bool = True
    # With train.grad_accum > 1, gradients are reduce-scattered after every micro-batch and
    # accumulated as shards (only HSDP's replicate all-reduce and replicate's all-reduce wait
    # for the last one).  true: keep whole gradients between micro-batches and reduce once
    # (fewer collectives; every rank then holds the whole unit's gradients: the plan shows it).
    accumulate_unsharded: bool = False
    # The names this policy gives the mesh's dims when mesh.dim_names is not set (a tensor-parallel
    # policy names its `tp` dim: [shard, tp] for fsdp_tp on mesh=2x2); the mesh must have as many dims.
    mesh_dim_names: list[str] | None = None


# the attention and MLP projections of a decoder layer, named as transformers (and composerun's Llama) name them
LORA_TARGETS = ["**.{q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj}"]


@dataclass
class AdapterConfig:
    name: Adapter = Adapter.none
    rank: int = 8  # the adapters' inner dimension r: A is r x in, B is out x r
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (the base linear sees it undropped)
    # FQN globs (as in sharding rules) of the nn.Linear modules that get an adapter
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # FQN globs of base parameters that train too (norms, embeddings: `**.norm.weight`); the rest are frozen
    train: list[str] = field(default_factory=list)


@dataclass
class OptimConfig:
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 0
    schedule: Schedule = Schedule.cosine
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 turns clipping off; the norm is logged either way


@dataclass
class DataConfig:
    _target_: str = "composerun.data.SyntheticData"
    batch_size: int = 8  # global: split evenly over the data-parallel ranks
    seed: int = 1234
    path: str | None = None
    # micro-batches made ahead on a background thread (pinned memory on a GPU); 0: each in its
    # step, for a data source that is not thread-safe (one drawing from torch's global RNG)
    prefetch: int = 2
    # DataLoader worker processes that make the micro-batches (null: 2 on a GPU, 0 on a CPU mesh,
    # where the ranks already use every core)
    workers: int | None = None
    # tokens per training sequence (null: model.seq_len); at most the model's max_seq_len
    seq_len: int | None = None
    # held-out split for evaluation: the last val_fraction of the tokens, or a file/glob of its own
    val_fraction: float = 0.01
    val_path: str | None = None
    # element type of raw `.bin` token files (null: uint16 when model.vocab_size <= 65536, else uint32)
    token_dtype: TokenDType | None = None
    # the tokenizer the tokens came from (a tokenizer.json or a directory with one), copied into a
    # Hugging Face export; null: model.pretrained's, else the one the token files record
    tokenizer: str | None = None
    # data=sft: several conversations packed into each row (kept apart: no attention between
    # them), or one conversation a row, padded (false)
    packing: bool = True


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end
    at_end: bool = True
    keep: int = 2
    resume: str = "auto"  # auto | never | PATH
    export: Export = Export.none
    # checkpoint.export=hf: the largest safetensors file, as save_pretrained's max_shard_size (5GB, 500MB,
    # 2GiB or bytes); a larger model is split into model-0000K-of-0000N files with an index
    export_max_shard_size: str = "5GB"
    init_from: str | None = None
    verify: bool = False
    checksum: Checksum = Checksum.xxh3_128  # of every file, in the manifest, checked on resume
    direct_io: bool = False  # write the files with O_DIRECT (where the file system has it), not the page cache
    # through the page cache: plain buffered writes (false), or each 32 MiB handed to writeback and the one
    # before waited for and dropped (true: faster on a VM's local disk, a round trip per 32 MiB on Lustre/NFS)
    bounded_cache: bool = False
    # torch.save's CRC-32 in the files' zip records: off, since the manifest's checksums cover every
    # byte (composerun/checkpoint/writer.py); on, for tools that read the files as zip archives
    zip_crc32: bool = False
    # a run that does not continue the checkpoints of its run directory (resume=never, another
    # checkpoint, nothing to resume after a finished run) is refused there unless this is true;
    # then the earlier run's files are moved aside into RUN_DIR/replaced-<date>_<time>/
    start_over: bool = False
    # `checkpoint.async` on the command line (a Python keyword; see _with_async): save in the
    # background, the step waiting only for the staged copy of the state
    async_: bool = False


@dataclass
class TrainConfig:
    steps: int = 20
    seed: int = 0
    grad_accum: int = 1
    # a metrics row (the host's read of the step's values) every N steps: null = 1 on a CPU mesh,
    # 10 on GPUs (a read waits for the step, so the host could not queue the next one's work ahead)
    log_every: int | None = None
    # torch's deterministic algorithms: null (default) = on for a CPU mesh, where they cost nothing,
    # off on GPUs (torchtitan's choice: some CUDA kernels are slower); true = on everywhere (and
    # cuBLAS's fixed workspace).  Never with torch's filling of new memory (~25 % of a CPU step).
    deterministic: bool | None = None


@dataclass
class EvalConfig:
    every: int = 0  # validation loss every N steps (and after the last); 0: never
    batches: int = 8  # global batches of the held-out split per evaluation (the same ones each time)
    batch_size: int | None = None  # global; null: data.batch_size


@dataclass
class MetricsConfig:
    # where each logged row goes (train/sinks.py): metrics.jsonl always; null: jsonl, and tensorboard
    # when metrics.tensorboard=true (its meaning before sinks existed, kept)
    sinks: list[Sink] | None = None
    tensorboard: bool = False  # true: tensorboard is one of the sinks, whatever metrics.sinks lists
    wandb_project: str | None = None  # default: $WANDB_PROJECT, else composerun
    wandb_entity: str | None = None  # default: $WANDB_ENTITY, else W&B's default entity
    mlflow_uri: str | None = None  # the tracking URI; default: $MLFLOW_TRACKING_URI, else MLflow's (./mlruns)
    mlflow_experiment: str | None = None  # default: $MLFLOW_EXPERIMENT_NAME, else composerun
    progress: bool = True  # a tqdm bar on rank 0, silent when stderr is not a terminal
    # the accelerator's peak FLOP/s per rank, for MFU (null: the GPU's datasheet bf16 dense peak
    # where composerun knows it; none on a CPU)
    peak_flops: float | None = None
    # the peak memory of one step (the second) measured on every rank with torch's memory tracker, for
    # summary.json's measured_peak_bytes_per_rank beside plan=true's estimate (that step runs slower)
    track_memory: bool = True


@dataclass
class ProfileConfig:
    # [A, B]: torch.profiler traces of steps A to B (inclusive) on every rank, in profile/rank{R}/
    # (train/profile.py); null: no profiler at all
    steps: list[int] | None = None
    # a GPU's allocator history, dumped as a snapshot in profile/rank{R}/: when a rank runs out of
    # memory (on_oom), after profile.steps (steps), or never (off); nothing on a CPU
    memory_snapshot: MemorySnapshot = MemorySnapshot.on_oom
    # the last N collectives of every rank (torch's flight recorder), dumped to
    # RUN/flight_recorder/rank_{R} when one times out (train/flight_recorder.py); 0: none kept
    flight_recorder: int = 2000


@dataclass
class PlanConfig:
    # plan=true (shorthand for plan.enabled=true): plan this config on its mesh in this process, on torch's
    # fake process group and fake tensors; no rank starts and nothing trains (parallel/planner.py)
    enabled: bool = False
    estimate: bool = True  # peak memory per rank and step time from one fake training step (parallel/estimate.py)
    # the accelerator planned for: a name of composerun/devices.py, or a map of a device's figures
    # ({base: H100, memory_gib: 94}); null: the memory check needs plan.memory_gib, the step time a
    # device.  (Any: a str-or-map; config/validate.py checks it, devices.plan_device reads it.)
    device: Any = None
    memory_gib: float | None = None  # memory per rank to fit in (default: the device's)
    link_gbps: float | None = None  # the intra-node link per GPU and direction, Gbit/s (default: the device's)
    # ranks are numbered row-major on the mesh and fill nodes of this many GPUs in rank order; a
    # collective whose groups cross nodes is priced at the NICs (parallel/topology.py)
    gpus_per_node: int = 8
    internode_gbps: float | None = None  # one GPU's inter-node NIC per direction, Gbit/s (default: the device's)
    search_batch: bool = True  # the largest micro-batch that fits (the fake step run at other sizes)


@dataclass
class CompileConfig:
    # what a module of an `api: compile` rule does when torch.compile cannot compile it
    fallback: CompileFallback = CompileFallback.error


@dataclass
class LaunchConfig:
    # forkserver: torch and composerun imported once, in the fork server, which forks every rank (about
    # half of torchrun's start-up: BENCHMARKS.md); fork would copy this process's threads' locks
    start_method: StartMethod = StartMethod.forkserver
    monitor_interval: float = 0.1
    omp_threads: int | None = None  # default: cores / local ranks
    # Several nodes of a SLURM job (hydra/launcher=slurm): each starts mesh size / nodes ranks; they meet
    # on the job's first host at rdzv_port (default: from the job id); cpus_per_rank sizes the request
    nodes: int = 1
    # A node range (elastic on SLURM, mesh.elastic=true): the run goes on with min_nodes to `nodes`
    # nodes, its ranks restarted on those left (max_restarts; null: 3 with a range, else 0)
    min_nodes: int | None = None
    max_restarts: int | None = None
    rdzv_port: int | None = None
    # torch's c10d rendezvous settings (torchrun's --rdzv-conf), whole seconds: last_call_timeout, ...
    rdzv_conf: dict[str, int] = field(default_factory=dict)
    cpus_per_rank: int = 4
    # more ranks on this machine than 4 per CPU core (or 1 per GPU) is refused unless true
    oversubscribe: bool = False
    # seconds the ranks get to checkpoint and exit after a preemption signal, before SIGKILL
    # (torch's agent; default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)
    shutdown_timeout: int | None = None
    # seconds a collective waits for every rank of its group before this rank fails (the
    # process group's timeout; profile.flight_recorder then says where the ranks were)
    collective_timeout: float = 600


@dataclass
class Config:
    model: ModelConfig = MISSING
    mesh: MeshConfig = field(default_factory=MeshConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # plan=true: plan only (PlanConfig above): plan.json with the estimate, no rank is started
    plan: PlanConfig = field(default_factory=PlanConfig)


def _with_async(node: DictConfig) -> DictConfig:
    """The CLI contract names `checkpoint.async`, which no dataclass field can be called: the
    field `async_` is the key `async` here, a typed bool node validated like every other key
    (config/typed.py maps it back)."""
    OmegaConf.set_struct(node, False)
    del node["async_"]
    node["async"] = BooleanNode(False)
    OmegaConf.set_struct(node, True)
    return node


def _open_kwargs(node: DictConfig) -> DictConfig:
    """`model.kwargs` and `optim.kwargs` take any key (constructor arguments): not struct, so
    that `'model.kwargs={depth: 3}'` merges as typed, without Hydra's `+`."""
    OmegaConf.set_struct(node.kwargs, False)
    return node


def register() -> None:
    cs = ConfigStore.instance()
    root = OmegaConf.structured(Config)
    _with_async(root.checkpoint)
    _open_kwargs(root.optim)
    OmegaConf.set_struct(root.launch.rdzv_conf, False)  # torch's names, checked by validate.py
    cs.store(name="composerun_schema", node=root)
    for group, schema in [
        ("model", _open_kwargs(OmegaConf.structured(ModelConfig))),
        ("mesh", MeshConfig),
        ("sharding", ShardingConfig),
        ("optim", _open_kwargs(OmegaConf.structured(OptimConfig))),
        ("data", DataConfig),
        ("adapter", AdapterConfig),
        ("train", TrainConfig),
    ]:
        cs.store(group=group, name="_schema", node=schema)
    cs.store(group="checkpoint", name="_schema", node=_with_async(OmegaConf.structured(CheckpointConfig)))
    # hydra/launcher/slurm.yaml sizes the SLURM request from the mesh with this resolver.
    OmegaConf.register_new_resolver("composerun.per_node", ranks_per_node, replace=True)
    register_slurm(cs)  # (its node range, and the launcher's schema)
