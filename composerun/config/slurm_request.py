"""What `hydra/launcher=slurm` (composerun/configs/hydra/launcher/slurm.yaml) asks SLURM for
beyond hydra-submitit-launcher's own keys: with a node range (launch.min_nodes), the range and
SLURM's `--no-kill`, for the job (sbatch) and for its step (srun).  Without `--no-kill` SLURM
ends the whole job, and the step's tasks on every node, when one node fails: the nodes left
could not go on.

The plugin's schema (its 1.2 release) has no key for srun's arguments, which submitit takes
(`srun_args`; the plugin's later sources name it the same): the launcher's schema here is the
plugin's with that key added."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from composerun.config.elastic import node_range


def sbatch_nodes(nodes: Any, min_nodes: Any, elastic: Any) -> dict[str, Any]:
    """The sbatch lines of a node range (`additional_parameters`): `--nodes=MIN-MAX`, which lets
    SLURM start the job on fewer nodes than launch.nodes, and `--no-kill`; none without one.  A
    range that is none is refused here, before the job is submitted (the rule's check of every
    world in it is validate.py's, on the job's nodes, before any rank starts)."""
    span = node_range(int(nodes or 1), None if min_nodes is None else int(min_nodes), bool(elastic))
    return {} if span is None else {"nodes": f"{span[0]}-{span[1]}", "no-kill": True}


def srun_nodes(nodes: Any, min_nodes: Any, elastic: Any) -> list[str]:
    """srun's arguments of a node range: `--no-kill`, so that the step's tasks on the nodes left
    go on when one node fails (their agents then restart the ranks without it); none without one."""
    return [] if not sbatch_nodes(nodes, min_nodes, elastic) else ["--no-kill"]


def register(cs: ConfigStore) -> None:
    """The launcher's schema (hydra/launcher/_slurm_schema, where hydra-submitit-launcher is
    installed) and the resolvers slurm.yaml uses."""
    OmegaConf.register_new_resolver("composerun.sbatch_nodes", sbatch_nodes, replace=True)
    OmegaConf.register_new_resolver("composerun.srun_nodes", srun_nodes, replace=True)
    try:
        from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    except ImportError:  # composerun[slurm] is not installed: hydra/launcher=slurm says so (Hydra)
        return

    @dataclass
    class SlurmConf(SlurmQueueConf):
        # (Any: a typed container would resolve slurm.yaml's interpolation while Hydra composes
        # the launcher's config alone, before launch.* exists)
        additional_parameters: Any = field(default_factory=dict)
        srun_args: Any = None

    cs.store(group="hydra/launcher", name="_slurm_schema", node=SlurmConf, provider="composerun")
