"""API keys: 401 for a missing or wrong key over either header, /health and /metrics open or closed
by their flags, keys from flags, files and config files, and the refusal to listen beyond this
machine without a key."""
from __future__ import annotations

import hmac
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from moerun.engine.runtime import Runtime
from moerun.server import auth
from moerun.server.app import create_app
from moerun.server.auth import Access, ApiKeys, is_loopback, keys_given
from moerun.server.worker import Worker
from tests.server.live import ANNOUNCED, SERVE, TIMEOUT_S, live_server
from tests.support.live_processes import wait_until

KEYS = ("key-one", "key-two")
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}
MAX_BODY = 1 << 20


def serving(demo_model, **access) -> TestClient:
    """An in-process app over the demo model, all experts local, behind `access`."""
    return TestClient(create_app(Worker(lambda: Runtime(demo_model)), "demo", MAX_BODY, Access(**access)))


def ready(client: TestClient, headers: dict | None = None) -> None:
    wait_until(lambda: client.get("/health", headers=headers).status_code == 200, 30, "a loaded model")


@pytest.fixture(scope="module")
def client(demo_model):
    with serving(demo_model, keys=KEYS) as client:
        ready(client)
        yield client


def rejected(client: TestClient) -> float:
    return client.app.state.worker.metrics.registry.get_sample_value("moerun_requests_total", {"outcome": "rejected"})


@pytest.mark.parametrize("headers, words", [
    ({}, "this server needs an API key"),
    ({"Authorization": "Bearer key-three"}, "not valid"),
    ({"x-api-key": "key-three"}, "not valid"),
    ({"Authorization": "Basic key-one"}, "this server needs an API key"),       # not a bearer token
    ({"Authorization": "Bearer key-one-and-more"}, "not valid"),
    ({"Authorization": "Bearer key-on"}, "not valid"),
])
def test_a_missing_or_wrong_key_gets_401_in_the_openai_shape(client, headers, words):
    before = rejected(client)
    reply = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    error = reply.json()["error"]
    assert words in error["message"] and "key-three" not in error["message"]
    assert (error["type"], error["code"], error["param"]) == ("authentication_error", "invalid_api_key", None)
    assert rejected(client) == before + 1


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/demo", "/v1/completions", "/v2/anything"])
def test_every_path_but_the_open_ones_needs_the_key(client, path):
    assert client.get(path).status_code == 401


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer key-one"},
    {"Authorization": "bearer key-two"},
    {"x-api-key": "key-two"},
    {"Authorization": "Bearer wrong", "x-api-key": "key-one"},
])
def test_the_right_key_over_either_header_is_served(client, headers):
    reply = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("public_health, public_metrics", [(True, False), (False, True), (False, False),
                                                           (True, True)])
def test_health_and_metrics_are_open_or_closed_by_their_flags(demo_model, public_health, public_metrics):
    with_key = {"x-api-key": "key-one"}
    with serving(demo_model, keys=KEYS, public_health=public_health, public_metrics=public_metrics) as client:
        ready(client, with_key)
        assert client.get("/health").status_code == (200 if public_health else 401)
        assert client.get("/metrics").status_code == (200 if public_metrics else 401)
        assert client.get("/metrics", headers=with_key).status_code == 200


def test_without_keys_everything_is_open(demo_model):
    with serving(demo_model) as client:
        ready(client)
        assert client.get("/metrics").status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_every_key_is_compared_every_time(monkeypatch):
    """No early exit on the first match: the comparisons made do not tell which key matched."""
    compared, compare = [], hmac.compare_digest

    def counting(a, b):
        compared.append((a, b))
        return compare(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ApiKeys(["first", "second", "third"])
    for presented, accepted in [([b"first"], True), ([b"third"], True), ([b"none"], False),
                                ([b"none", b"second"], True), ([], False)]:
        compared.clear()
        assert keys.accepts(presented) is accepted
        assert len(compared) == 3 * len(presented)


def test_keys_from_flags_and_a_file(tmp_path):
    file = tmp_path / "keys"
    file.write_text("  file-one  \n\nfile-two\n")
    assert keys_given(("a,b", "c"), None) == ("a", "b", "c")
    assert keys_given(("a",), str(file)) == ("a", "file-one", "file-two")


@pytest.mark.parametrize("contents, words", [
    (None, "cannot read it: No such file or directory"),
    ("", "holds no key: write one key per line"),
    ("\n  \n", "holds no key"),
    ("good\nhas a space\n", "line 2: a key is visible ASCII characters"),
    (b"\xff\xfe", "not UTF-8 text"),
])
def test_a_bad_key_file_is_one_clear_message(tmp_path, contents, words):
    file = tmp_path / "keys"
    if isinstance(contents, bytes):
        file.write_bytes(contents)
    elif contents is not None:
        file.write_text(contents)
    with pytest.raises(ValueError, match="--api-key-file") as caught:
        keys_given((), str(file))
    assert words in str(caught.value) and "good" not in str(caught.value)


def test_a_key_file_that_is_a_folder_cannot_be_read(tmp_path):
    with pytest.raises(ValueError, match="cannot read it: Is a directory"):
        keys_given((), str(tmp_path))


@pytest.mark.parametrize("value", ["", "a,", "a b", "ключ"])
def test_a_malformed_flag_key_is_refused_without_echoing_it(value):
    with pytest.raises(ValueError) as caught:
        keys_given((value,), None)
    assert str(caught.value) == ("--api-key: a key is one or more visible ASCII characters, without spaces; "
                                 "several keys are separated by commas")


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True), ("LOCALHOST", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("10.0.0.1", False), ("example.com", False),
    ("", False),
])
def test_only_loopback_addresses_count_as_this_machine(host, loopback):
    assert is_loopback(host) is loopback


# -- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20"])
def test_listening_beyond_this_machine_without_a_key_is_refused(moerun, tmp_path, host):
    """The model does not exist: an error about it would mean the check came later."""
    result = moerun("serve", "-m", tmp_path / "missing.gguf", "--host", host, "--port", "0")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"Error: --host {host} is reachable from other machines and the server has no API key: give --api-key KEY "
        "or --api-key-file FILE, listen on 127.0.0.1, or add --insecure to serve everyone who reaches it"]


def test_a_config_files_host_is_refused_alike(moerun, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text(f'model = "{tmp_path / "missing.gguf"}"\n[server]\nhost = "0.0.0.0"\nport = 0\n')
    result = moerun("serve", "--config", config)
    assert result.exit_code == 1 and "Error: --host 0.0.0.0 is reachable from other machines" in result.stderr


def test_insecure_listens_beyond_this_machine_with_a_warning(tmp_path):
    """The check passes, the model is loaded next and fails: its error ends the command."""
    result = subprocess.run([sys.executable, *SERVE, "-m", str(tmp_path / "missing.gguf"), "--host", "0.0.0.0",
                             "--port", "0", "--insecure"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 1
    assert "--insecure: no API key, so whoever reaches --host 0.0.0.0 may use the server" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("Error: ") and "missing.gguf" in result.stderr


def test_a_missing_key_file_ends_the_command_before_anything_loads(moerun, tmp_path):
    result = moerun("serve", "-m", tmp_path / "missing.gguf", "--api-key-file", tmp_path / "nokeys", "--port", "0")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: --api-key-file {tmp_path / 'nokeys'}: cannot read it: No such file or directory"]


def test_a_live_server_with_keys_from_its_config_file(demo_model, tmp_path):
    """Keys from a file named relative to the config; the served URL printed once, with the port
    --port 0 picked; /health closed by the file, /metrics opened by the flag."""
    (tmp_path / "keys").write_text("live-key\n")
    config = tmp_path / "rig.toml"
    config.write_text(f'model = "{demo_model}"\n[server]\napi_key_file = "keys"\npublic_health = false\n')
    log = tmp_path / "server.log"
    with live_server(log, "--config", config, "--public-metrics") as (url, _):
        assert not url.endswith(":0")
        assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 401
        assert httpx.get(f"{url}/health", headers={"x-api-key": "live-key"}, timeout=TIMEOUT_S).json() == \
            {"status": "ok"}
        assert httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).status_code == 200
        with openai.OpenAI(base_url=f"{url}/v1", api_key="live-key", max_retries=0, timeout=TIMEOUT_S) as client:
            reply = client.chat.completions.create(model="demo-moe-v2", max_tokens=3, temperature=0,
                                                   messages=[{"role": "user", "content": "hi"}])
        with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0, timeout=TIMEOUT_S) as client:
            with pytest.raises(openai.AuthenticationError, match="not valid"):
                client.models.list()
        assert refused_before_the_body(url) == 401
    assert reply.usage.completion_tokens == 3
    announced = ANNOUNCED.findall(log.read_text())
    assert announced == [("demo-moe-v2", url)] and url.startswith("http://127.0.0.1:")


def refused_before_the_body(url: str) -> int:
    """The status a POST declaring a 40 MB body gets without sending any of it (a server waiting
    for the body would time the read out)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 40000000\r\n\r\n")
        return int(connection.makefile("rb").readline().split()[1])
