"""Two small tokenizers trained in milliseconds, one of each family that detokenization must get
right: byte-level BPE (GPT-2, Llama 3, SmolLM: multi-byte characters split over tokens) and
SentencePiece-style BPE with byte fallback (Llama 2, Mistral: ``▁`` for spaces, the first
token's leading space stripped, ``<0xE4>`` byte tokens for characters outside the vocabulary).
"""

from __future__ import annotations

import json
from typing import Any

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "a b c d e f g h i j k l m n o p q r s t u v w x y z"] * 20
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _wrap(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=SPECIAL[3:])


def byte_level_bpe() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _wrap(tok)


def sentencepiece_bpe() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIAL,
                                                        show_progress=False))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # byte fallback: characters outside the vocabulary become bytes
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    return _wrap(Tokenizer.from_str(json.dumps(data)))
