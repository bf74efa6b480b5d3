"""A live `moerun serve` at its limits: bodies over --max-body are refused unread, big prompts
are tokenized while /health keeps answering, a full context ends a reply with "length", and a
busy port or a bad flag ends the command with one `Error:` line before anything loads."""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.live import (
    SERVE,
    TIMEOUT_S,
    live_server,
    metric,
    peak_memory_bytes,
    scrape,
)
from tests.support.live_processes import free_port

BODY_LIMIT = 1 << 20          # --max-body of the `bodies` server
FORTY_MB = 40 * 10**6
CTX = 48                      # --ctx of the `prompts` server
BIG_PROMPT_BYTES = 3 * 10**6  # a second or more of tokenizing on a 2-core machine; under its 8 MiB --max-body
# A free event loop answers /health in milliseconds; a loop blocked by a big body or prompt takes
# about as long as that body or prompt takes. The bound sits between, far from both (see
# HealthProbe.assert_answered_at_once).
HEALTH_BOUND_S = 5.0


@pytest.fixture(scope="module")
def bodies(demo_model, tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("bodies") / "server.log", "-m", demo_model,
                     "--max-body", "1MiB") as (url, process):
        yield url, process


@pytest.fixture(scope="module")
def prompts(demo_model, tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("prompts") / "server.log", "-m", demo_model,
                     "--ctx", CTX, "--max-body", "8MiB") as (url, _):
        yield url


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def read_reply(connection: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the HTTP reply on a raw connection."""
    replies = connection.makefile("rb")
    status = int(replies.readline().split()[1])
    headers = {}
    while (line := replies.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, json.loads(replies.read(int(headers["content-length"])))


def assert_too_large(status: int, body: dict, words: str) -> None:
    assert status == 413
    error = body["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert words in error["message"] and f"at most {BODY_LIMIT} bytes (--max-body)" in error["message"]


class HealthProbe:
    """GETs /health over one kept-alive connection, one after another, until the block ends;
    `latencies` holds how long each took, `statuses` what each answered, `seconds` how long the
    block took."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.running = threading.Event()

    def __enter__(self):
        self.running.set()
        self.thread = threading.Thread(target=self._probe, daemon=True)
        self.thread.start()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        self.running.clear()
        self.thread.join(TIMEOUT_S)

    def assert_answered_at_once(self) -> None:
        """Each probe took a small part of the block's time (a blocked loop makes one probe take
        nearly all of it), and under HEALTH_BOUND_S."""
        assert len(self.latencies) >= 3, f"fewer than 3 /health probes ran in {self.seconds:.2f} s"
        bound = min(HEALTH_BOUND_S, self.seconds / 3)
        assert set(self.statuses) == {200} and max(self.latencies) < bound, (bound, self.latencies)

    def _probe(self) -> None:
        with httpx.Client(base_url=self.url, timeout=TIMEOUT_S) as client:
            while self.running.is_set():
                started = time.perf_counter()
                self.statuses.append(client.get("/health").status_code)
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.02)


# -- request bodies ------------------------------------------------------------------------

def test_a_declared_body_over_max_body_is_refused_before_any_of_it_is_sent(bodies):
    url, _ = bodies
    with socket.create_connection(address(url), timeout=10) as connection:
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {FORTY_MB}\r\n\r\n".encode())
        status, body = read_reply(connection)       # a server waiting for the body times this out
    assert_too_large(status, body, f"is {FORTY_MB} bytes")


def test_a_40_mb_body_is_refused_while_health_keeps_answering(bodies):
    """The body goes out at about 20 MB/s, so /health is asked while it is sent."""
    url, _ = bodies
    body = json.dumps({"model": "demo-moe-v2", "prompt": "word " * (FORTY_MB // 5)}).encode()

    def send(connection: socket.socket) -> None:
        try:
            for offset in range(0, len(body), 1 << 20):
                connection.sendall(body[offset:offset + (1 << 20)])
                time.sleep(0.05)
        except OSError:
            pass                                    # the server may close the connection first

    with socket.create_connection(address(url), timeout=TIMEOUT_S) as connection, HealthProbe(url) as probe:
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode())
        sender = threading.Thread(target=send, args=(connection,), daemon=True)
        sender.start()
        status, reply = read_reply(connection)
        sender.join(TIMEOUT_S)
    assert_too_large(status, reply, f"is {len(body)} bytes")
    probe.assert_answered_at_once()


def test_a_chunked_body_is_cut_off_at_max_body_and_never_held(bodies):
    url, process = bodies
    peak_before = peak_memory_bytes(process.pid)
    megabyte = b"x" * 10**6
    reply = httpx.post(f"{url}/v1/chat/completions", content=(megabyte for _ in range(40)),
                       headers={"content-type": "application/json"}, timeout=TIMEOUT_S)   # no length: chunked
    assert_too_large(reply.status_code, reply.json(), f"is over {BODY_LIMIT} bytes")
    assert peak_memory_bytes(process.pid) - peak_before < 20 * 10**6


@pytest.mark.parametrize("size, status", [(BODY_LIMIT, 200), (BODY_LIMIT + 1, 413)])
def test_max_body_is_the_largest_body_served(bodies, size, status):
    url, _ = bodies
    request = {"model": "demo-moe-v2", "prompt": "The rig", "max_tokens": 2, "padding": ""}
    request["padding"] = "x" * (size - len(json.dumps(request)))       # an unknown field, ignored
    body = json.dumps(request).encode()
    assert len(body) == size
    reply = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=TIMEOUT_S)
    assert reply.status_code == status, reply.text


def test_max_body_from_a_config_file(demo_model, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text(f'model = "{demo_model}"\n\n[server]\nmax_body = "1KiB"\n')
    with live_server(tmp_path / "server.log", "--config", config) as (url, _):
        small = httpx.post(f"{url}/v1/completions", json={"model": "demo-moe-v2", "prompt": "x", "max_tokens": 1},
                           timeout=TIMEOUT_S)
        big = httpx.post(f"{url}/v1/completions", json={"model": "demo-moe-v2", "prompt": "x" * 1024},
                         timeout=TIMEOUT_S)
    assert small.status_code == 200, small.text
    assert big.status_code == 413 and "at most 1024 bytes (--max-body)" in big.json()["error"]["message"]


def test_replies_on_a_kept_alive_connection_are_not_held_back(bodies):
    """The server's sockets have TCP_NODELAY: without it, the body of each reply waits for the
    client's delayed acknowledgement of its headers, 40 ms on Linux: every reply would take that
    long, while a loaded machine still answers most well under it."""
    url, _ = bodies
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        latencies = []
        for _ in range(20):
            started = time.perf_counter()
            client.get("/health")
            latencies.append(time.perf_counter() - started)
    assert statistics.median(latencies) < 0.035, latencies


# -- prompts ----------------------------------------------------------------------------------

def big_text() -> str:
    words = "The rig hums in the corner of the workshop; the experts wait. "
    return (words * (BIG_PROMPT_BYTES // len(words) + 1))[:BIG_PROMPT_BYTES]


@pytest.mark.parametrize("path, request_fields", [
    ("/v1/completions", lambda text: {"prompt": text}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
])
def test_health_answers_while_a_big_prompt_is_tokenized(prompts, path, request_fields):
    with HealthProbe(prompts) as probe:
        reply = httpx.post(f"{prompts}{path}", json={"model": "demo-moe-v2", **request_fields(big_text())},
                           timeout=TIMEOUT_S)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded"
    count = int(error["message"].split("the prompt has ")[1].split()[0])
    assert count > BIG_PROMPT_BYTES // 10 and f"at most {CTX - 1}" in error["message"]
    probe.assert_answered_at_once()


def test_a_token_id_prompt_over_the_context_is_refused(prompts):
    reply = httpx.post(f"{prompts}/v1/completions", json={"model": "demo-moe-v2", "prompt": [1] * 10**5},
                       timeout=TIMEOUT_S)
    assert reply.status_code == 400 and "the prompt has 100000 tokens" in reply.json()["error"]["message"]


def test_a_full_context_ends_with_finish_reason_length(prompts):
    """Without max_tokens a reply runs until the context is full (greedy from this prompt, the
    demo model gives no end-of-turn token for well over CTX tokens)."""
    before = scrape(prompts)
    request = {"model": "demo-moe-v2", "messages": [{"role": "user", "content": "The rig"}], "temperature": 0}
    whole = httpx.post(f"{prompts}/v1/chat/completions", json=request, timeout=TIMEOUT_S).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["total_tokens"] == CTX and whole["usage"]["completion_tokens"] > 0

    with httpx.stream("POST", f"{prompts}/v1/chat/completions", timeout=TIMEOUT_S,
                      json={**request, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == \
        whole["choices"][0]["message"]["content"]

    last_room = httpx.post(f"{prompts}/v1/completions", timeout=TIMEOUT_S,
                           json={"model": "demo-moe-v2", "prompt": [1] * (CTX - 1), "temperature": 0}).json()
    assert last_room["choices"][0]["finish_reason"] == "length" and last_room["usage"]["completion_tokens"] == 1
    after = scrape(prompts)
    moved = metric(after, "moerun_requests_total", outcome="length") - \
        metric(before, "moerun_requests_total", outcome="length")
    assert moved == 3


# -- the command line -------------------------------------------------------------------------

def serve_command(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *SERVE, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_a_busy_port_ends_the_command_before_anything_loads(tmp_path):
    """The model named does not exist: an error about it would mean loading came first."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = serve_command("-m", tmp_path / "missing.gguf", "--host", "127.0.0.1", "--port", port)
    assert result.returncode == 1, result.stderr
    assert result.stdout == "" and result.stderr.splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another program listens there: stop it or pick another --port)"]


@pytest.mark.parametrize("value, words", [("lots", "--max-body: cannot read size 'lots'"),
                                          ("0", "--max-body must be at least 1 byte")])
def test_a_bad_max_body_is_one_error_line(tmp_path, value, words):
    result = serve_command("-m", tmp_path / "missing.gguf", "--port", free_port(), "--max-body", value)
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"Error: {words}"), result.stderr
