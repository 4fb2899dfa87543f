"""Data: the sources a run trains on (sources.py), indexed by global sample index so that
every mesh sees the same global batches.  `data._target_` names a class here (or a user's)."""

from composerun.data.sources import SyntheticData, TextData, build_data

__all__ = ["SyntheticData", "TextData", "build_data"]
