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
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repeat_penalty,
            sampling.presence_penalty, sampling.frequency_penalty) == (1.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0)


def test_model_may_be_left_out():
    chat = {key: value for key, value in CHAT.items() if key != "model"}
    assert parse_chat(chat).generation.model is None
    assert parse_completion({"prompt": "x"}).generation.model is None
    assert parse_chat({**CHAT, "model": None}).generation.model is None


def test_presence_and_frequency_penalties_reach_the_sampler():
    sampling = parse_chat({**CHAT, "presence_penalty": -2, "frequency_penalty": 1.5}).generation.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-2.0, 1.5)
    sampling = parse_completion({"prompt": "x", "presence_penalty": 2.0, "frequency_penalty": -0.5}).generation.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (2.0, -0.5)


def test_sampling_fields_and_extensions():
    chat = parse_chat({**CHAT, "temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": -1,
                       "max_completion_tokens": 9, "max_tokens": 3, "stop": "\n", "stream": True,
                       "stream_options": {"include_usage": True}})
    s, g = chat.generation.sampling, chat.generation
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.5, 7, 0.1, 2**64 - 1)
    assert (g.max_tokens, g.stop, g.stream, g.include_usage) == (9, ("\n",), True, True)


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}


def test_content_parts_join():
    chat = parse_chat({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}]})
    assert chat.messages == [{"role": "user", "content": "ab"}]


def test_every_role_the_api_has():
    """developer is rendered as system; an assistant's tool calls and a tool reply's id reach the
    template; null content is empty beside tool calls."""
    chat = parse_chat({**CHAT, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "You forecast."},
        {"role": "user", "content": "Weather in Oslo?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "rain"}]},
        {"role": "assistant", "content": "Rain.", "tool_calls": []},
    ]})
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "You forecast."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "assistant", "content": "Rain."},
    ]


ROLES_MESSAGE = "must be one of system, developer, user, assistant, tool"


@pytest.mark.parametrize("message, param, words", [
    ({"role": "wizard", "content": "x"}, "messages[1].role", f'{ROLES_MESSAGE} (got "wizard")'),
    ({"role": 3, "content": "x"}, "messages[1].role", f"{ROLES_MESSAGE} (got 3)"),
    ({"content": "x"}, "messages[1].role", f"{ROLES_MESSAGE} (got null)"),
    ("hello", "messages[1]", "messages[1] must be an object (got a string)"),
    (None, "messages[1]", "messages[1] must be an object (got null)"),
    ({"role": "user", "content": None}, "messages[1].content", "missing or null"),
    ({"role": "user"}, "messages[1].content", "missing or null"),
    ({"role": "assistant", "content": None}, "messages[1].content",
     "only an assistant message with tool_calls may leave it out"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[1].content", "missing or null"),
    ({"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}, "messages[1].tool_calls",
     "only an assistant message makes tool calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
     "messages[1].tool_calls", "must be an array of"),
    ({"role": "assistant", "content": None, "tool_calls": "call"}, "messages[1].tool_calls", "must be an array of"),
    ({"role": "tool", "tool_call_id": 7, "content": "x"}, "messages[1].tool_call_id", "must be a string"),
    ({"role": "user", "content": 5}, "messages[1].content", "a string or an array of text parts"),
])
def test_bad_messages_name_their_index(message, param, words):
    error = refusal(parse_chat, {**CHAT, "messages": [{"role": "user", "content": "first"}, message]})
    assert error.param == param and words in error.message and error.code == "invalid_value"


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
    ({"messages": [{"content": "x"}]}, "messages[0].role", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "text only"),
    ({"model": 3}, "model", "a string"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "a number"),
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
