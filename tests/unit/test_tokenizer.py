"""Tokenizers built from GGUF metadata, checked against independent tokenizers of the same vocabulary.

Oracles: the Hugging Face tokenizer the byte-level vocabulary was trained as, transformers' own GGUF
loader reading the same metadata from a real GGUF file, and SentencePiece for Llama-style vocabularies.
"""

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from moerun.gguf.tokenizer import (
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    USER_DEFINED,
    Tokenizer,
    TokenizerError,
    TooManyTokens,
)
from moerun.gguf.vocab import bpe_metadata, byte_level_bpe
from tests.support.vocabs import (
    CORPUS,
    SAMPLES,
    byte_level_tokenizer,
    sentencepiece_metadata,
    sentencepiece_processor,
    write_gguf,
)

WITH_SPECIALS = [
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n",
    "text before<|endoftext|>text after",
    "<|im_end|><|im_end|>",
    "spaces around <|im_start|> a special",
    "an unfinished <|im_start and a lone |>",
]


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def hf_oracle(byte_level):
    return PreTrainedTokenizerFast(tokenizer_object=byte_level)


def qwen_style_metadata(byte_level, pre="qwen2", **overrides):
    metadata = bpe_metadata(byte_level, pre=pre, bos="<|endoftext|>", eos="<|im_end|>", chat_template=None)
    return {**metadata, **overrides}


@pytest.fixture(scope="module")
def qwen(byte_level):
    return Tokenizer.from_metadata(qwen_style_metadata(byte_level))


@pytest.fixture(scope="module")
def sp():
    return sentencepiece_processor()


@pytest.fixture(scope="module")
def llama(sp):
    return Tokenizer.from_metadata(sentencepiece_metadata(sp))


def pushed(tokenizer, ids):
    stream = tokenizer.stream_decoder()
    return [stream.push(token_id) for token_id in ids] + [stream.flush()]


# Byte-level BPE ("gpt2")


@pytest.mark.parametrize("text", SAMPLES + WITH_SPECIALS)
def test_byte_level_ids_match_hugging_face(qwen, hf_oracle, text):
    assert qwen.encode(text) == hf_oracle.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", SAMPLES + WITH_SPECIALS)
def test_byte_level_decode_round_trips(qwen, hf_oracle, text):
    ids = qwen.encode(text)
    assert qwen.decode(ids) == text == hf_oracle.decode(ids)
    assert qwen.decode(ids, skip_special=True) == hf_oracle.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", SAMPLES + WITH_SPECIALS)
def test_byte_level_stream_joins_up_to_decode(qwen, text):
    ids = qwen.encode(text)
    assert "".join(pushed(qwen, ids)) == qwen.decode(ids)


def test_stream_holds_back_an_emoji_until_its_last_byte(qwen):
    ids = qwen.encode("🦙")
    assert len(ids) > 1
    assert pushed(qwen, ids) == [""] * (len(ids) - 1) + ["🦙", ""]


def test_stream_replaces_bytes_that_never_form_a_character(qwen):
    ids = qwen.encode("🦙")[:-1] + qwen.encode("ok")
    assert qwen.decode(ids) == "\ufffdok"
    assert "".join(pushed(qwen, ids)) == "\ufffdok"


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe", "gpt-4o", "tekken", "gpt-2", "olmo"])
def test_gguf_file_matches_transformers_gguf_loader(byte_level, tmp_path, pre):
    metadata = qwen_style_metadata(byte_level, pre=pre)
    write_gguf(tmp_path / "vocab.gguf", metadata, arch="qwen2")
    oracle = AutoTokenizer.from_pretrained(tmp_path, gguf_file="vocab.gguf")
    ours = Tokenizer.from_metadata(metadata)
    for text in SAMPLES + WITH_SPECIALS:
        assert ours.encode(text) == oracle.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_round_trips(byte_level, pre):
    tokenizer = Tokenizer.from_metadata(qwen_style_metadata(byte_level, pre=pre))
    for text in SAMPLES + WITH_SPECIALS:
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text
    assert tokenizer.encode("<|im_end|>", add_bos=False) == [tokenizer.eos_id]


def test_user_defined_tokens_are_matched_whole():
    trained = byte_level_tokenizer()
    trained.add_tokens(["<think>"])
    metadata = bpe_metadata(trained, pre="qwen2", bos=None, eos="<|im_end|>", chat_template=None)
    think = trained.token_to_id("<think>")
    assert metadata["tokenizer.ggml.token_type"][think] == USER_DEFINED
    text = "a<think>reasoning</think> b"
    ours = Tokenizer.from_metadata(metadata)
    assert think in ours.encode(text)
    assert ours.encode(text) == PreTrainedTokenizerFast(tokenizer_object=trained).encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special=True) == text


# Exporting and training


def test_metadata_marks_added_special_tokens_as_control(byte_level):
    metadata = qwen_style_metadata(byte_level)
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    vocab = byte_level.get_vocab(with_added_tokens=True)
    assert tokens == sorted(vocab, key=vocab.get)
    assert {tokens[i] for i in np.flatnonzero(types == CONTROL)} == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert set(types.tolist()) == {NORMAL, CONTROL}
    assert metadata["tokenizer.ggml.eos_token_id"] == vocab["<|im_end|>"]
    assert metadata["tokenizer.ggml.bos_token_id"] == vocab["<|endoftext|>"]
    assert all(" " in merge for merge in metadata["tokenizer.ggml.merges"])


def test_training_is_deterministic():
    first = byte_level_bpe(CORPUS, 800, ["<|im_end|>"]).to_str()
    assert byte_level_bpe(CORPUS, 800, ["<|im_end|>"]).to_str() == first
    other_process = subprocess.run(
        [sys.executable, "-c", "import hashlib; from tests.support.vocabs import CORPUS; "
         "from moerun.gguf.vocab import byte_level_bpe; "
         "print(hashlib.sha256(byte_level_bpe(CORPUS, 800, ['<|im_end|>']).to_str().encode()).hexdigest())"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
    )
    assert other_process.stdout.strip() == hashlib.sha256(first.encode()).hexdigest()


# SentencePiece ("llama")


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_ids_match(llama, sp, text):
    assert llama.encode(text) == [sp.bos_id()] + sp.encode(text)
    assert llama.encode(text, add_bos=False) == sp.encode(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_decode_matches(llama, sp, text):
    ids = llama.encode(text)
    assert llama.decode(ids, skip_special=True) == sp.decode(ids) == text
    assert "".join(pushed(llama, ids)) == llama.decode(ids)


def test_characters_outside_the_vocabulary_fall_back_to_bytes(llama, sp):
    ids = llama.encode("龍 🦙", add_bos=False)
    assert [llama.token_text(i) for i in ids] == sp.id_to_piece(sp.encode("龍 🦙"))
    assert any(llama.token_text(i).startswith("<0x") for i in ids)
    assert pushed(llama, ids)[-2:] == ["🦙", ""]


def test_sentencepiece_text_after_a_special_token_gets_its_own_space_prefix(llama, sp):
    # llama.cpp prefixes every run of text between special tokens with a space, not only the first.
    text = "Hi</s>there <s> x<unk>y"
    expected = [1] + sp.encode("Hi") + [2] + sp.encode("there ") + [1] + sp.encode(" x") + [0] + sp.encode("y")
    assert llama.encode(text) == expected


def test_sentencepiece_matches_transformers_gguf_loader(sp, tmp_path):
    # transformers' Metaspace adds no prefix to text that starts with a space nor after a special
    # token, unlike SentencePiece and llama.cpp, so only text without either is compared.
    metadata = sentencepiece_metadata(sp)
    write_gguf(tmp_path / "vocab.gguf", metadata, arch="llama")
    oracle = AutoTokenizer.from_pretrained(tmp_path, gguf_file="vocab.gguf")
    ours = Tokenizer.from_metadata(metadata)
    for text in SAMPLES:
        if not text[:1].isspace():
            assert ours.encode(text) == oracle.encode(text), text


# BOS, EOS and stop tokens


def test_add_bos_defaults_follow_llama_cpp(byte_level, llama):
    gpt2_metadata = qwen_style_metadata(byte_level)
    del gpt2_metadata["tokenizer.ggml.add_bos_token"]
    assert Tokenizer.from_metadata(gpt2_metadata).add_bos is False
    assert Tokenizer.from_metadata({**gpt2_metadata, "tokenizer.ggml.pre": "llama-bpe"}).add_bos is True
    assert llama.add_bos is True


def test_add_bos_token_from_the_file_is_respected(byte_level, sp):
    no_bos = Tokenizer.from_metadata({**sentencepiece_metadata(sp), "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("Hello") == sp.encode("Hello")
    with_bos = Tokenizer.from_metadata(qwen_style_metadata(byte_level, **{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("Hello")[0] == with_bos.bos_id == byte_level.token_to_id("<|endoftext|>")


def test_add_bos_argument_overrides_the_file(llama, qwen, sp):
    assert llama.encode("Hello", add_bos=False) == sp.encode("Hello")
    assert qwen.encode("Hello", add_bos=True)[0] == qwen.bos_id


def test_bos_is_not_doubled(llama, sp):
    assert llama.encode("<s>Hello") == [1] + sp.encode("Hello")


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_max_tokens_refuses_a_longer_text_by_its_count(request, name):
    tokenizer = request.getfixturevalue(name)
    text = "The river town woke slowly. " * 50
    ids = tokenizer.encode(text)                     # llama: BOS included, and counted
    assert tokenizer.encode(text, max_tokens=len(ids)) == ids
    with pytest.raises(TooManyTokens) as refused:
        tokenizer.encode(text, max_tokens=len(ids) - 1)
    assert (refused.value.count, refused.value.limit) == (len(ids), len(ids) - 1)
    assert f"has {len(ids)} tokens" in str(refused.value)


def test_max_tokens_counts_no_second_bos(llama):
    ids = llama.encode("<s>Hello")
    assert llama.encode("<s>Hello", max_tokens=len(ids)) == ids


def test_add_bos_without_a_bos_token_is_an_error(byte_level):
    metadata = qwen_style_metadata(byte_level, **{"tokenizer.ggml.add_bos_token": True})
    del metadata["tokenizer.ggml.bos_token_id"]
    with pytest.raises(TokenizerError, match="bos_token_id is not set"):
        Tokenizer.from_metadata(metadata)


def test_stop_ids_hold_eos_and_eot(byte_level, llama):
    endoftext, im_end = byte_level.token_to_id("<|endoftext|>"), byte_level.token_to_id("<|im_end|>")
    metadata = qwen_style_metadata(
        byte_level, **{"tokenizer.ggml.eos_token_id": endoftext, "tokenizer.ggml.eot_token_id": im_end}
    )
    tokenizer = Tokenizer.from_metadata(metadata)
    assert tokenizer.eos_id == endoftext
    assert {endoftext, im_end} <= tokenizer.stop_ids
    assert llama.stop_ids == {llama.eos_id} == {2}


def test_token_text_and_vocab_size(qwen, byte_level):
    assert qwen.vocab_size == byte_level.get_vocab_size(with_added_tokens=True)
    assert qwen.token_text(qwen.eos_id) == "<|im_end|>"
    assert qwen.token_text(qwen.encode(" the")[0]) == "Ġthe"
    with pytest.raises(IndexError):
        qwen.token_text(qwen.vocab_size)


# Bad metadata


def _without(metadata, key):
    return {k: v for k, v in metadata.items() if k != key}


BAD_METADATA = {
    "no tokenizer model": (lambda m: _without(m, "tokenizer.ggml.model"), "no tokenizer"),
    "unknown model": (lambda m: {**m, "tokenizer.ggml.model": "rwkv"}, "unsupported tokenizer model 'rwkv'"),
    "no token list": (lambda m: _without(m, "tokenizer.ggml.tokens"), "no token list"),
    "empty token list": (lambda m: {**m, "tokenizer.ggml.tokens": []}, "no token list"),
    "token types too short": (
        lambda m: {**m, "tokenizer.ggml.token_type": m["tokenizer.ggml.token_type"][:-1]},
        "token_type has 999 entries, but tokenizer.ggml.tokens has 1000",
    ),
    "no merges": (lambda m: _without(m, "tokenizer.ggml.merges"), "merges"),
    "malformed merge": (lambda m: {**m, "tokenizer.ggml.merges": ["ab"]}, "malformed merge 'ab'"),
    "merge of unknown tokens": (lambda m: {**m, "tokenizer.ggml.merges": ["zzz yyy"]}, "cannot build"),
    "unknown pre-tokenizer": (lambda m: {**m, "tokenizer.ggml.pre": "klingon"}, "unsupported pre-tokenizer 'klingon'"),
    "eos outside the vocabulary": (lambda m: {**m, "tokenizer.ggml.eos_token_id": 5000}, "outside the vocabulary"),
    "duplicate token": (
        lambda m: {**m, "tokenizer.ggml.tokens": m["tokenizer.ggml.tokens"][:1] * 2 + m["tokenizer.ggml.tokens"][2:]},
        "duplicate token '!' in tokenizer.ggml.tokens (ids 0 and 1)",
    ),
    "spm without scores": (
        lambda m: _without({**m, "tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores"),
        "no tokenizer.ggml.scores",
    ),
}


@pytest.mark.parametrize("case", BAD_METADATA)
def test_bad_metadata_gives_a_clear_error(byte_level, case):
    spoil, message = BAD_METADATA[case]
    with pytest.raises(TokenizerError, match=re.escape(message)) as raised:
        Tokenizer.from_metadata(spoil(qwen_style_metadata(byte_level)))
    assert "\n" not in str(raised.value)
