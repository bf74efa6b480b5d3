"""Tokenizer.stream_decoder with characters cut across tokens: each push returns whole characters
only (a character comes out with the token that carries its last byte), the pieces join up to
decode()'s text, and U+FFFD stands only for bytes that never form a character."""
from __future__ import annotations

import pytest

from moerun.gguf.tokenizer import Tokenizer, byte_alphabet_decoder
from moerun.gguf.vocab import bpe_metadata
from tests.support.vocabs import (
    byte_level_tokenizer,
    sentencepiece_metadata,
    sentencepiece_processor,
)

CUT_TEXTS = ["café", "5 €", "🦙🙂", "naïve — ok", "東京", "e\u0301 and ✅"]


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def qwen(byte_level):
    return Tokenizer.from_metadata(bpe_metadata(byte_level, pre="qwen2", bos=None, eos="<|im_end|>",
                                                chat_template=None))


@pytest.fixture(scope="module")
def byte_ids(byte_level):
    """The id of the one-byte token of each byte value."""
    return {byte: byte_level.token_to_id(char) for char, byte in byte_alphabet_decoder().items()}


def pushed(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    stream = tokenizer.stream_decoder()
    return [stream.push(token_id) for token_id in ids], stream.flush()


def one_token_per_byte(text: str, byte_ids: dict[int, int]) -> list[int]:
    return [byte_ids[byte] for byte in text.encode()]


@pytest.mark.parametrize("text", CUT_TEXTS)
def test_a_character_comes_out_whole_with_its_last_byte(qwen, byte_ids, text):
    pieces, rest = pushed(qwen, one_token_per_byte(text, byte_ids))
    expected = [piece for char in text for piece in [""] * (len(char.encode()) - 1) + [char]]
    assert pieces == expected and rest == ""


@pytest.mark.parametrize("text", CUT_TEXTS)
def test_the_vocabulary_s_own_tokens_join_up_to_decode(qwen, text):
    """BPE merges here can end a token inside a character and start the next character in it."""
    ids = qwen.encode(text)
    pieces, rest = pushed(qwen, ids)
    assert "".join(pieces) + rest == qwen.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_sentencepiece_byte_tokens_are_held_back_too():
    """Characters outside a SentencePiece vocabulary come as <0xNN> byte tokens."""
    llama = Tokenizer.from_metadata(sentencepiece_metadata(sentencepiece_processor()))
    ids = llama.encode("a 龍 and 🦙", add_bos=False)
    pieces, rest = pushed(llama, ids)
    assert pieces.count("") >= 5                 # the bytes of 龍 and 🦙 but their last ones
    assert "".join(pieces) + rest == llama.decode(ids) == "a 龍 and 🦙"
    assert not any("\ufffd" in piece for piece in pieces)


def test_flush_replaces_an_unfinished_character_at_the_end(qwen, byte_ids):
    ids = one_token_per_byte("ok", byte_ids) + one_token_per_byte("€", byte_ids)[:2]
    pieces, rest = pushed(qwen, ids)
    assert pieces == ["o", "k", "", ""] and rest == "\ufffd"
    assert qwen.decode(ids) == "ok\ufffd"


@pytest.mark.parametrize("cut, expected", [
    (b"\xe2\x82" + b"ok", ["", "", "\ufffdo", "k"]),     # a character that never finishes
    (b"\xff" + b"ok", ["\ufffd", "o", "k"]),             # a byte no character starts with
    (b"\xa9" + b"ok", ["\ufffd", "o", "k"]),             # a continuation byte with no start
])
def test_bytes_that_never_form_a_character_are_replaced_where_they_stand(qwen, byte_ids, cut, expected):
    ids = [byte_ids[byte] for byte in cut]
    pieces, rest = pushed(qwen, ids)
    assert pieces == expected and rest == ""
    assert "".join(pieces) == qwen.decode(ids)
