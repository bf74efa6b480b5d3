"""Reply objects of the OpenAI API: chat.completion(.chunk), text_completion, usage, model list."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from moerun.server.worker import Finished


def usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "moerun"}]}


@dataclass
class Reply:
    """The objects one request is answered with; `chat` picks the chat or the text-completion shapes."""
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))
    token: str = field(default_factory=lambda: secrets.token_hex(12))

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.token}"

    def whole(self, text: str, finished: Finished) -> dict:
        """The non-streaming reply."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finished.reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finished.reason}
        return self._object(self._kind(streamed=False), [choice], usage=usage(finished))

    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant's role; a text stream needs no opening."""
        return self._chunk({"role": "assistant", "content": ""}, None) if self.chat else None

    def text_chunk(self, text: str) -> dict:
        return self._chunk({"content": text} if self.chat else text, None)

    def last_chunk(self, finished: Finished) -> dict:
        return self._chunk({} if self.chat else "", finished.reason)

    def usage_chunk(self, finished: Finished) -> dict:
        """stream_options.include_usage: a chunk with no choices and the usage."""
        return self._object(self._kind(streamed=True), [], usage=usage(finished))

    def _chunk(self, delta: dict | str, finish_reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._object(self._kind(streamed=True), [choice])

    def _kind(self, streamed: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if streamed else "chat.completion"
        return "text_completion"

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}
