"""Make composerun's shipped tokenizer and token shards from its shipped public-domain text.

    python scripts/make_assets.py

Trains a byte-level BPE tokenizer (VOCAB_SIZE tokens, its two special tokens included: the
size of +model=llama3_debug's vocabulary) with Hugging Face `tokenizers` on
composerun/assets/{sonnets,shakespeare}.txt and saves it as a Hugging Face tokenizer folder
(tokenizer.json, tokenizer_config.json, special_tokens_map.json: what
transformers.AutoTokenizer.from_pretrained reads).  Like Llama 3's, it puts
<|begin_of_text|> before every text it encodes.  Then tokenizes both files with
composerun-tokenize into composerun/assets/tokens/ (data=tokens' default), in two shards.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = Path(__file__).resolve().parents[1] / "composerun" / "assets"
TEXTS = [ASSETS / "sonnets.txt", ASSETS / "shakespeare.txt"]
VOCAB_SIZE = 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SHARD_TOKENS = 40_000  # two shards: the default data.path is a folder of several


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(t) for t in TEXTS], trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")


def main() -> int:
    from composerun.data.tokenize import main as tokenize

    tok = train_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, tok.get_vocab_size(with_added_tokens=True)
    save_tokenizer(tok, ASSETS / "tokenizer")
    shutil.rmtree(ASSETS / "tokens", ignore_errors=True)
    return tokenize(
        [*map(str, TEXTS), "--tokenizer", str(ASSETS / "tokenizer"), "--out", str(ASSETS / "tokens"),
         "--shard-tokens", str(SHARD_TOKENS), "--num-proc", "2"]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
