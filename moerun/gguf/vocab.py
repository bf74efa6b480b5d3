"""Byte-level BPE vocabularies for GGUF files: train a small one, and write one as GGUF metadata."""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moerun.errors import UsageError

from .tokenizer import (
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNUSED,
    USER_DEFINED,
    byte_level_pre_tokenizer,
)


def byte_level_bpe(corpus: str, vocab_size: int, specials: list[str]) -> Tokenizer:
    """Train a byte-level BPE on ``corpus`` with Qwen2's pre-tokenizer; the same corpus gives the same vocabulary.

    The 256 byte characters take the first ids, then come the tokens the merges learned (up to
    ``vocab_size`` tokens in all, fewer when the corpus runs out of pairs), then ``specials`` as
    special added tokens.
    """
    if vocab_size < 256 + len(specials):
        raise UsageError(f"vocab_size {vocab_size} leaves no room for the 256 bytes and {len(specials)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(PRE_TOKENIZERS["qwen2"].splits)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus], trainer)
    tokenizer.add_special_tokens(specials)
    return tokenizer


def bpe_metadata(tok: Tokenizer, *, pre: str, bos: str | None, eos: str, chat_template: str | None) -> dict:
    """The GGUF ``tokenizer.*`` metadata of a byte-level BPE tokenizer, as llama.cpp's converter writes it.

    Ids missing from the vocabulary become unused ``[PAD<id>]`` tokens; added tokens are control
    tokens when special (or spelled ``<|...|>``) and user-defined otherwise.
    """
    model = json.loads(tok.to_str())["model"]
    if model["type"] != "BPE":
        raise UsageError(f"expected a BPE tokenizer, got a {model['type']} one")
    vocab = tok.get_vocab(with_added_tokens=True)
    for name, text in (("bos", bos), ("eos", eos)):
        if text is not None and text not in vocab:
            raise UsageError(f"the {name} token {text!r} is not in the vocabulary")

    n_tokens = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n_tokens)]
    types = [UNUSED] * n_tokens
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for i, added in tok.get_added_tokens_decoder().items():
        looks_special = added.content.startswith("<|") and added.content.endswith("|>")
        types[i] = CONTROL if added.special or looks_special else USER_DEFINED

    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.merges": [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]],
        "tokenizer.ggml.eos_token_id": vocab[eos],
        "tokenizer.ggml.add_bos_token": False,
    }
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = vocab[bos]
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


UNUSED_TOKEN = 5   # GGUF token type "unused"


def pad_vocabulary(meta: dict, vocab_size: int) -> dict:
    """Grow bpe_metadata's vocabulary to vocab_size with unused [PAD<id>] tokens (a small corpus
    learns fewer merges than a model's vocabulary needs)."""
    tokens = meta["tokenizer.ggml.tokens"]
    extra = range(len(tokens), vocab_size)
    return {**meta,
            "tokenizer.ggml.tokens": tokens + [f"[PAD{i}]" for i in extra],
            "tokenizer.ggml.token_type": np.concatenate(
                [meta["tokenizer.ggml.token_type"], np.full(len(extra), UNUSED_TOKEN, np.int32)])}
