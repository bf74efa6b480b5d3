"""Chat templates: render a conversation into a prompt with the Jinja template a GGUF file carries.

Templates are rendered the way transformers' ``apply_chat_template`` does: in an immutable Jinja
sandbox with ``trim_blocks``/``lstrip_blocks``, the loop-controls extension, and the helpers Hugging
Face templates call (``raise_exception``, ``strftime_now``, a ``tojson`` filter that leaves non-ASCII
text as it is). A file without ``tokenizer.chat_template`` gets ``DEFAULT_CHATML``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import TokenizerError

# The fallback for files without a template: ChatML, as Qwen models write it, with no default system prompt.
DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(TokenizerError):
    """A chat template that does not compile, or that fails or refuses to render a conversation."""


class _RaisedByTemplate(jinja2.TemplateError):
    """What a template's ``raise_exception(message)`` raises."""


def render_chat(
    template: str,
    messages: list[dict],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """The prompt ``template`` makes of ``messages``.

    ``variables`` reach the template too (``tools``, ``enable_thinking``, ...). Raises
    ``ChatTemplateError`` when the template does not compile, calls ``raise_exception`` or fails.
    """
    compiled = _compile(template)
    context = {"tools": None, "documents": None, **variables}
    try:
        return compiled.render(
            **context,
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except _RaisedByTemplate as error:
        raise ChatTemplateError(f"the chat template rejected the conversation: {error.message}") from None
    except Exception as error:  # the template is code from the model file; any failure is its failure
        raise ChatTemplateError(f"the chat template failed to render: {type(error).__name__}: {error}") from error


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        message = f"the chat template has a syntax error on line {error.lineno}: {error.message}"
        raise ChatTemplateError(message) from None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _raise_exception(message: str):
    raise _RaisedByTemplate(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    """Jinja's own ``tojson`` escapes HTML characters; templates want plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def render_messages(tokenizer, messages: list[dict]) -> str:
    """The file's chat template (ChatML when it has none) applied to `messages`, ready for
    the assistant's reply."""
    template = tokenizer.chat_template or DEFAULT_CHATML
    return render_chat(template, messages,
                       bos_token=tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
                       eos_token=tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "")
