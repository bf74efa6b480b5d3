"""Request validation into OpenAI-style errors, and stop sequences over streamed text."""
from __future__ import annotations

import pytest

from moerun.server.schemas import ApiError, parse_chat, parse_completion
from moerun.server.stops import StopMatcher

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(parse, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value


def test_api_defaults_not_llama_cpp_defaults():
    sampling = parse_chat(CHAT).generation.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repeat_penalty) == \
        (1.0, 1.0, 0, 0.0, 1.0)


def test_sampling_fields_and_extensions():
    chat = parse_chat({**CHAT, "temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": -1,
                       "max_completion_tokens": 9, "max_tokens": 3, "stop": "\n", "stream": True,
                       "stream_options": {"include_usage": True}})
    s, g = chat.generation.sampling, chat.generation
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.5, 7, 0.1, 2**64 - 1)
    assert (g.max_tokens, g.stop, g.stream, g.include_usage) == (9, ("\n",), True, True)


def test_content_parts_join_and_null_content_is_empty():
    chat = parse_chat({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]},
                                            {"role": "assistant", "content": None}]})
    assert chat.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("prompt, expected", [("x", "x"), (["x"], "x"), ([1, 2], [1, 2]), ([[3]], [3])])
def test_completion_prompts(prompt, expected):
    assert parse_completion({"model": "m", "prompt": prompt}).prompt == expected


@pytest.mark.parametrize("change, param, words", [
    ({"max_tokens": -1}, "max_tokens", "at least 1"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": "5"}, "max_tokens", "an integer"),
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"temperature": True}, "temperature", "a number"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "at least 0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [1]}, "stop", "strings"),
    ({"n": 2}, "n", "not supported"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": []}, "messages", "at least one"),
    ({"messages": [{"content": "x"}]}, "messages[0]", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "text only"),
    ({"model": None}, "model", "'model'"),
    ({"stream_options": "yes"}, "stream_options", "an object"),
])
def test_bad_chat_fields_name_the_parameter(change, param, words):
    error = refusal(parse_chat, {**CHAT, **change})
    assert error.param == param and words in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", [[], "text", None, 3])
def test_body_must_be_an_object(body):
    assert "JSON object" in refusal(parse_chat, body).message


@pytest.mark.parametrize("prompt", [[], [1.5], [True], ["a", "b"], 7])
def test_bad_completion_prompts(prompt):
    assert refusal(parse_completion, {"model": "m", "prompt": prompt}).param == "prompt"


def stream_through(sequences, pieces):
    matcher = StopMatcher(tuple(sequences))
    out = [matcher.push(piece) for piece in pieces]
    return out, matcher.stopped, matcher.flush()


def test_text_without_stop_sequences_passes_at_once():
    assert stream_through([], ["ab", "c"]) == (["ab", "c"], False, "")


def test_stop_sequence_split_over_pieces_is_never_sent():
    out, stopped, _ = stream_through(["END"], ["x E", "N", "D tail"])
    assert "".join(out) == "x " and stopped
    assert out[0] == "x "                    # "E" held back: it may start "END"


def test_a_false_start_is_released():
    out, stopped, rest = stream_through(["END"], ["a EN", "d b", "E"])
    assert "".join(out) == "a ENd b" and not stopped and rest == "E"


def test_the_earliest_stop_sequence_wins():
    out, stopped, _ = stream_through(["bc", "ab"], ["xabc"])
    assert out == ["x"] and stopped


def test_nothing_after_a_stop():
    matcher = StopMatcher(("!",))
    assert matcher.push("hi! there") == "hi" and matcher.push("more") == "" and matcher.flush() == ""
