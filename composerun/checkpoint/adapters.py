"""Adapter-only checkpoints (`adapter=lora`): a checkpoint holds what trains (the adapters, any
`adapter.train` parameter, their optimizer state) besides the data position and RNG, never the
frozen base, which the run reads again from where it came from: `model.pretrained`'s files, or
the seeded initialization (`train.seed`, the model's config).  The manifest records which base
that is (`base`: the pretrained files' checksums, or the seed), and a resume against another
base is refused before any rank starts: the adapters were trained for that base only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composerun.checkpoint.manifest import file_checksum
from composerun.config.schema import Config
from composerun.errors import ConfigError

ALGORITHM = "xxh3_128"
WEIGHT_SUFFIXES = (".safetensors", ".json")  # the tensors, and the index and config that place them


def base_identity(cfg: Config) -> dict[str, Any] | None:
    """What the frozen base of an adapter run is, for its checkpoints' manifest; None without an adapter."""
    if str(cfg.adapter.name) == "none":
        return None
    if not cfg.model.pretrained:
        return {"pretrained": None, "seed": cfg.train.seed}
    directory = Path(cfg.model.pretrained)
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(".safetensors"))
    return {"pretrained": str(directory), ALGORITHM: {p.name: file_checksum(p, ALGORITHM) for p in files}}


def check_base(cfg: Config, manifest: dict[str, Any], path: Path) -> None:
    """ConfigError (one line) when the checkpoint at `path` was trained on another base than this run's."""
    stored = manifest.get("base")
    if stored is None:
        return  # a checkpoint of the whole model: it holds its base itself
    here = base_identity(cfg)
    if here is None:
        raise ConfigError(f"{path} holds adapters only (adapter=lora); resume it with adapter=lora and its base model")
    if stored.get(ALGORITHM) != here.get(ALGORITHM) or stored.get("seed") != here.get("seed"):
        what = stored.get("pretrained") or f"the initialization of train.seed={stored.get('seed')}"
        now = here.get("pretrained") or f"the initialization of train.seed={here.get('seed')}"
        raise ConfigError(
            f"{path} holds adapters trained on other base weights ({what}) than this run's ({now}): "
            "resume them on that base, or start over with checkpoint.resume=never"
        )
