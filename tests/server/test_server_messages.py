"""Requests through the app in-process: `model` left out, every role rendered by the chat
template, refused roles and null content, and the presence and frequency penalties in effect."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages
from moerun.server.app import create_app
from moerun.server.worker import Worker
from tests.support.live_processes import wait_until

USER = {"role": "user", "content": "The rig"}


@pytest.fixture(scope="module")
def runtime(demo_model):
    with Runtime(demo_model) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def client(demo_model):
    with TestClient(create_app(Worker(lambda: Runtime(demo_model)), "demo-moe-v2", 1 << 20)) as client:
        wait_until(lambda: client.get("/health").status_code == 200, 30, "a loaded model")
        yield client


def greedy(runtime: Runtime, prompt_ids: list[int], n: int, **penalties) -> str:
    tokens = runtime.generate(prompt_ids, n, SamplingParams(temperature=0.0, **penalties), runtime.tokenizer.stop_ids)
    return runtime.tokenizer.decode(list(tokens), skip_special=True)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [USER]}),
                                        ("/v1/completions", {"prompt": "The rig"})])
def test_without_model_the_served_model_answers(client, path, body):
    reply = client.post(path, json={**body, "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["model"] == "demo-moe-v2"
    assert reply.json()["usage"]["completion_tokens"] == 3


def test_a_model_of_another_name_is_still_not_found(client):
    reply = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [USER]})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_tool_messages_are_rendered_by_the_chat_template(client, runtime):
    """The demo model has no template: ChatML renders each message's role and content, developer as system."""
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    messages = [{"role": "developer", "content": "Be brief."}, USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    reply = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    rendered = render_messages(runtime.tokenizer, [{"role": "system", "content": "Be brief."}, USER,
                                                   {"role": "assistant", "content": ""},
                                                   {"role": "tool", "content": "rain"}])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in rendered and "<|im_start|>tool\nrain<|im_end|>" in rendered
    prompt_ids = runtime.tokenizer.encode(rendered)
    assert reply.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    assert reply.json()["choices"][0]["message"]["content"] == greedy(runtime, prompt_ids, 6)


@pytest.mark.parametrize("message, param", [({"role": "wizard", "content": "x"}, "messages[1].role"),
                                            ({"role": "user", "content": None}, "messages[1].content"),
                                            ("x", "messages[1]")])
def test_bad_messages_get_400_naming_them(client, message, param):
    reply = client.post("/v1/chat/completions", json={"messages": [USER, message]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


@pytest.mark.parametrize("penalties", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                       {"frequency_penalty": -2.0, "presence_penalty": 0.5}])
def test_penalties_change_greedy_text_as_the_sampler_applies_them(client, runtime, penalties):
    def completion(**fields) -> str:
        reply = client.post("/v1/completions", json={"prompt": "The rig", "max_tokens": 24, "temperature": 0,
                                                     **fields})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    prompt_ids = runtime.tokenizer.encode("The rig")
    penalised = completion(**penalties)
    assert penalised == greedy(runtime, prompt_ids, 24, **penalties) != completion()


def test_a_penalty_out_of_range_is_400(client):
    reply = client.post("/v1/completions", json={"prompt": "x", "frequency_penalty": 2.5})
    assert reply.status_code == 400 and "frequency_penalty must be in [-2, 2]" in reply.json()["error"]["message"]
