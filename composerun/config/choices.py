"""The choices of the config's keys: each an Enum whose members are their own strings, so that a value outside
them fails while Hydra composes, naming the key (schema.py's dataclasses type their fields with these)."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A key's choices: each is its own string too, so `cfg.model.task == "tokens"` holds (as it
    did when the ranks got plain dicts) and prints as `tokens`."""

    def __str__(self) -> str:
        return self.value


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Backend(Choice):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Api(Choice):
    fully_shard = "fully_shard"
    replicate = "replicate"
    checkpoint = "checkpoint"
    compile = "compile"  # torch.compile of the module's forward (parallel/compile.py)
    float8 = "float8"  # torchao's float8 training of the module's linears (parallel/float8.py)
    parallelize = "parallelize"  # tensor/sequence parallel over the mesh dim `tp` (parallel/styles.py)


class DType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Task(Choice):
    regression = "regression"  # dense features in, dense targets out, MSE
    tokens = "tokens"  # token ids in, next-token logits out, cross-entropy


class Schedule(Choice):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class Export(Choice):
    none = "none"
    safetensors = "safetensors"
    hf = "hf"  # a Hugging Face model directory, RUN/export/hf/ (a model with a Hugging Face equivalent)
    peft = "peft"  # the adapters as a PEFT directory, RUN/export/peft/ (adapter=lora)


class Adapter(Choice):
    none = "none"  # every parameter trains
    lora = "lora"  # low-rank adapters beside the target linears; the base weights frozen (models/lora.py)


class TokenDType(Choice):
    uint16 = "uint16"
    uint32 = "uint32"


class Checksum(Choice):
    xxh3_128 = "xxh3_128"  # fast, not cryptographic: catches damaged and truncated files
    sha256 = "sha256"  # cryptographic, about 10x slower here


class CompileFallback(Choice):
    error = "error"  # a module that fails to compile ends the run: one line naming the rule and the module
    eager = "eager"  # a warning, and the module runs uncompiled


class StartMethod(Choice):
    spawn = "spawn"
    fork = "fork"
    forkserver = "forkserver"


class Sink(Choice):
    """metrics.sinks: where each logged step's row goes besides metrics.jsonl (train/sinks.py)."""

    jsonl = "jsonl"  # metrics.jsonl: always written, listed or not
    tensorboard = "tensorboard"  # event files in tb/
    wandb = "wandb"  # Weights & Biases (the `wandb` extra)
    mlflow = "mlflow"  # MLflow (the `mlflow` extra)


class MemorySnapshot(Choice):
    """profile.memory_snapshot: when a GPU's allocator history is dumped (train/profile.py)."""

    on_oom = "on_oom"  # kept from the start; dumped when a rank runs out of memory
    steps = "steps"  # kept over profile.steps, dumped after them
    off = "off"
