"""Data: the sources a run trains on, indexed by global sample index so that every mesh sees
the same global batches: synthetic and byte-level text (sources.py), pre-tokenized shards
(tokens.py, token_files.py) that composerun-tokenize (tokenize.py) writes, and its chat
shards' conversations (sft.py).  `data._target_`
names a class here (or a user's)."""

from composerun.data.sft import SFTData
from composerun.data.sources import SyntheticData, TextData, build_data, check_seq_len, meta_batch
from composerun.data.tokens import TokenData, check_tokens

__all__ = [
    "SFTData",
    "SyntheticData",
    "TextData",
    "TokenData",
    "build_data",
    "check_seq_len",
    "check_tokens",
    "meta_batch",
]
