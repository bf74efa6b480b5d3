"""Streamed text from a live server whose model spells characters over several tokens: every
streamed piece is whole characters, and the pieces join up to the text the tokenizer decodes."""
from __future__ import annotations

import json

import httpx
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model
from tests.server.live import TIMEOUT_S, live_server

CYCLE = "é€🦙 "
# A byte-level vocabulary of the 256 bytes and two merges, with a word-pair head: after a space
# or a newline comes "é", and the model repeats CYCLE, its characters cut across tokens.
CORPUS = (CYCLE * 5 + "\n") * 40
MODEL = SyntheticConfig(name="utf8", n_layers=1, hidden=288, n_heads=2, n_kv_heads=1, head_dim=32, n_experts=4,
                        n_experts_used=2, expert_ff=32, vocab_size=261, context=256, ftype="F32")
MODEL_ID = "utf8-moe"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("model") / f"{MODEL_ID}.gguf", MODEL, CORPUS,
                                 bigram_head=True)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("server") / "server.log", "-m", model) as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference(model):
    with Runtime(model) as runtime:
        yield runtime


def expected_text(runtime: Runtime, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    """The text of the greedy continuation, and how many of its tokens complete no character."""
    tokenizer = runtime.tokenizer
    ids = list(runtime.generate(prompt_ids, max_tokens, GREEDY, tokenizer.stop_ids))
    assert len(ids) == max_tokens
    stream = tokenizer.stream_decoder(skip_special=True)
    return tokenizer.decode(ids, skip_special=True), [stream.push(i) for i in ids].count("")


def streamed_pieces(url: str, path: str, request: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json={**request, "stream": True}, timeout=TIMEOUT_S) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    pieces = [choice["text"] if "text" in choice else choice["delta"].get("content", "") for choice in choices]
    return [piece for piece in pieces if piece]


def test_completion_streams_whole_characters(server, reference):
    prompt_ids = reference.tokenizer.encode(CYCLE)
    max_tokens = 3 * len(prompt_ids)                     # three cycles: the text ends between characters
    text, cut = expected_text(reference, prompt_ids, max_tokens)
    assert text == CYCLE * 3 and cut > 0
    request = {"model": MODEL_ID, "prompt": CYCLE, "max_tokens": max_tokens, "temperature": 0}

    pieces = streamed_pieces(server, "/v1/completions", request)
    assert not any("\ufffd" in piece for piece in pieces), pieces
    assert "".join(pieces) == text
    whole = httpx.post(f"{server}/v1/completions", json=request, timeout=TIMEOUT_S).json()
    assert whole["choices"][0]["text"] == text


def test_chat_streams_whole_characters(server, reference):
    messages = [{"role": "user", "content": "hi"}]
    prompt_ids = reference.tokenizer.encode(render_messages(reference.tokenizer, messages))
    max_tokens = 2 * len(reference.tokenizer.encode(CYCLE))
    text, _ = expected_text(reference, prompt_ids, max_tokens)
    assert text == CYCLE * 2

    pieces = streamed_pieces(server, "/v1/chat/completions",
                             {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert not any("\ufffd" in piece for piece in pieces), pieces
    assert "".join(pieces) == text


def test_a_reply_cut_inside_a_character_ends_with_one_replacement_character(server, reference):
    """max_tokens ends the text one byte into "€": the byte that never became a character is
    U+FFFD, in the stream as in the whole reply and the tokenizer's decoding."""
    prompt_ids = reference.tokenizer.encode(CYCLE)
    text, _ = expected_text(reference, prompt_ids, 3)
    assert text == "é\ufffd"
    request = {"model": MODEL_ID, "prompt": CYCLE, "max_tokens": 3, "temperature": 0}
    assert streamed_pieces(server, "/v1/completions", request) == ["é", "\ufffd"]
    assert httpx.post(f"{server}/v1/completions", json=request, timeout=TIMEOUT_S).json()["choices"][0]["text"] == text
