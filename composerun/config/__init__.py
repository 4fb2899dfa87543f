"""The config: typed schemas of every group (schema.py) and the checks of a composed config
(validate.py).  `composerun/configs/` holds the YAML options; each group extends its schema here."""

from composerun.config.schema import (
    Api,
    Backend,
    Checksum,
    Config,
    Device,
    DType,
    Export,
    Schedule,
    StartMethod,
    Task,
    mesh_dim_names,
    ranks_per_node,
    register,
    target_class,
    world_size_of,
)
from composerun.config.typed import to_plain, to_typed
from composerun.config.validate import (
    MESH_RE,
    key_hint,
    register_mesh_shapes,
    shipped_options,
    unknown_key,
    validate,
    world_size,
)

__all__ = [
    "Api", "Backend", "Checksum", "Config", "DType", "Device", "Export", "MESH_RE", "Schedule", "StartMethod", "Task",
    "mesh_dim_names", "ranks_per_node", "register", "register_mesh_shapes", "shipped_options", "target_class",
    "key_hint", "to_plain", "to_typed", "unknown_key", "validate", "world_size", "world_size_of",
]  # fmt: skip
