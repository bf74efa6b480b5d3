"""Request bodies of the OpenAI API, checked field by field into what the engine needs.

Every problem becomes an `ApiError` that the app sends as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status. Sampling defaults are the
API's, not llama.cpp's: temperature 1, top_p 1, and top_k, min_p, repeat_penalty off.
`model` may be left out: the one model served answers, as llama-server's does.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from moerun.engine.sampler import SamplingParams
from moerun.errors import MoerunError

MAX_STOP_SEQUENCES = 4
SEED_MASK = (1 << 64) - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_ROLES = {"developer": "system"}    # roles chat templates know by another name

# Fields of the API this server does not implement, and the values that mean "not used".
UNSUPPORTED_UNLESS = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
}


class ApiError(MoerunError):
    """A request the server refuses, with the status and OpenAI error body to answer it with."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s        # a Retry-After header: when to ask again

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Generation:
    """What both endpoints share: the model asked for, how many tokens, how to sample and stop, how to reply."""
    model: str | None                  # None: whichever model the server runs
    max_tokens: int | None             # None: as many as the context leaves
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool                # stream_options.include_usage: a last chunk with the usage


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]               # [{"role", "content": str}, plus "tool_calls" or "tool_call_id"]
    generation: Generation


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]            # text, or token ids
    generation: Generation


def parse_chat(body: Any) -> ChatRequest:
    fields = Fields(body)
    messages = fields.require("messages", list)
    if not messages:
        raise invalid("messages", "messages must hold at least one message")
    return ChatRequest([_message(i, m) for i, m in enumerate(messages)], _generation(fields, chat=True))


def parse_completion(body: Any) -> CompletionRequest:
    fields = Fields(body)
    return CompletionRequest(_prompt(fields.require("prompt", (str, list))), _generation(fields, chat=False))


class Fields:
    """Typed access to the fields of a JSON object; a missing optional field or null gives the default."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        self.body = body

    def require(self, name: str, kind: type | tuple[type, ...]) -> Any:
        value = self.body.get(name)
        if value is None:
            raise ApiError(400, f"you must provide the '{name}' field", param=name, code="missing_required_parameter")
        return self._typed(name, value, kind)

    def get(self, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = self.body.get(name)
        return default if value is None else self._typed(name, value, kind)

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = float(self.get(name, (int, float), default))
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            raise invalid(name, f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}] (got {value:g})")
        return value

    def integer(self, name: str, default: int | None, low: int) -> int | None:
        value = self.get(name, int, default)
        if value is not None and value < low:
            raise invalid(name, f"{name} must be at least {low} (got {value})")
        return value

    @staticmethod
    def _typed(name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join(_JSON_NAMES[k] for k in kinds)
            raise ApiError(400, f"{name} must be {expected} (got {_JSON_NAMES[type(value)]})",
                           param=name, code="invalid_type")
        return value


_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object", type(None): "null"}


def _generation(fields: Fields, chat: bool) -> Generation:
    for name, unused in UNSUPPORTED_UNLESS.items():
        if fields.body.get(name) not in unused:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    max_tokens = fields.integer("max_completion_tokens", None, low=1) if chat else None
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", None, low=1)
    stream = fields.get("stream", bool, False)
    options = Fields(fields.get("stream_options", dict, {}))
    return Generation(
        model=fields.get("model", str, None),
        max_tokens=max_tokens,
        sampling=_sampling(fields),
        stop=_stop(fields.get("stop", (str, list), [])),
        stream=stream,
        include_usage=stream and options.get("include_usage", bool, False),
    )


def _sampling(fields: Fields) -> SamplingParams:
    seed = fields.get("seed", int, None)
    return SamplingParams(
        temperature=fields.number("temperature", 1.0, 0.0, 2.0),
        top_p=fields.number("top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=fields.integer("top_k", 0, low=0),
        min_p=fields.number("min_p", 0.0, 0.0, 1.0),
        repeat_penalty=fields.number("repeat_penalty", 1.0, 0.0, 10.0, low_open=True),
        repeat_last_n=fields.integer("repeat_last_n", 64, low=0),
        presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
        seed=None if seed is None else seed & SEED_MASK,
    )


def _stop(stop: str | list) -> tuple[str, ...]:
    sequences = [stop] if isinstance(stop, str) else stop
    if len(sequences) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) for s in sequences):
        raise invalid("stop", f"stop must be a string or an array of at most {MAX_STOP_SEQUENCES} strings")
    return tuple(s for s in sequences if s)


def _message(index: int, message: Any) -> dict:
    """One message as the chat template reads it: a known role (developer as system), its content
    as one string, and an assistant's tool_calls or a tool reply's tool_call_id where given.
    Content may be null only beside tool_calls."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(param, f"{param} must be an object (got {_JSON_NAMES[type(message)]})")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{param}.role", f"{param}.role must be one of {', '.join(ROLES)} (got {json_text(role)})")
    rendered = {"role": TEMPLATE_ROLES.get(role, role)}
    if message.get("tool_calls") not in (None, []):
        if role != "assistant":
            raise invalid(f"{param}.tool_calls", f"{param}.tool_calls: only an assistant message makes tool calls")
        rendered["tool_calls"] = _tool_calls(f"{param}.tool_calls", message["tool_calls"])
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise invalid(f"{param}.tool_call_id", f"{param}.tool_call_id must be a string")
        rendered["tool_call_id"] = message["tool_call_id"]
    rendered["content"] = _content(f"{param}.content", message.get("content"), may_be_null="tool_calls" in rendered)
    return rendered


def _content(param: str, content: Any, may_be_null: bool) -> str:
    if content is None and may_be_null:
        return ""
    if content is None:
        raise invalid(param, f"{param} is missing or null; only an assistant message with tool_calls "
                             "may leave it out")
    if isinstance(content, list):
        return "".join(_text_part(f"{param}[{i}]", part) for i, part in enumerate(content))
    if not isinstance(content, str):
        raise invalid(param, f"{param} must be a string or an array of text parts")
    return content


def _tool_calls(param: str, calls: Any) -> list[dict]:
    """Calls the assistant made, as the API writes them: {"type": "function", "function": {"name", "arguments"}}."""
    def well_formed(call: Any) -> bool:
        function = call.get("function") if isinstance(call, dict) else None
        return (isinstance(function, dict) and call.get("type", "function") == "function"
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str))
    if not isinstance(calls, list) or not all(well_formed(call) for call in calls):
        raise invalid(param, f"{param} must be an array of {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": \"...\"}} objects")
    return calls


def json_text(value: Any) -> str:
    """A short JSON rendering of a value for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _text_part(param: str, part: Any) -> str:
    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        raise invalid(param, f"{param} must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                             "this server reads text only")
    return part["text"]


def _prompt(prompt: str | list) -> str | list[int]:
    """A string, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise invalid("prompt", "prompt must be a string or an array of token ids (one prompt per request)")
