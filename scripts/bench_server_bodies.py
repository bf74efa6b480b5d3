"""Big request bodies against `moerun serve`: how fast one over --max-body is refused, and how
fast /health and /metrics answer while such a body is sent and while a big prompt is tokenized.

    python scripts/bench_server_bodies.py [--body-mb 40] [--prompt-mb 8] [--json]

Starts two servers of its own on 127.0.0.1 (the built-in demo model, no daemons): one with the
default --max-body, to refuse a --body-mb body sent with a Content-Length and one sent chunked,
and one with --max-body above --prompt-mb, to tokenize a --prompt-mb prompt (which is then
refused as longer than the context). Meanwhile another connection asks /health or /metrics
every 20 ms. Prints the timings and the server's peak memory (VmHWM); stops the servers after.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

MB = 10**6
CHUNK = 1 << 20
PROBE_INTERVAL_S = 0.02
START_TIMEOUT_S = 120


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body-mb", type=float, default=40.0, help="size of the bodies to refuse (MB)")
    parser.add_argument("--prompt-mb", type=float, default=8.0, help="size of the prompt to tokenize (MB)")
    parser.add_argument("--send-mb-per-s", type=float, default=20.0,
                        help="pace of the body sent while /health is probed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    from moerun.writers.demo import demo_model_path
    model = demo_model_path()
    model_id = model.name.removesuffix(".gguf")
    body = completion_body(model_id, prompt_of(int(args.body_mb * MB) - 100))
    results = {}
    with server(model) as (url, process):
        results["refuse_content_length"] = refuse(url, body, chunked=False)
        results["refuse_chunked"] = refuse(url, body, chunked=True)
        results["health_while_sending"] = while_running(
            url, "/health", lambda: refuse(url, body, chunked=False, pace=args.send_mb_per_s))
        results["peak_memory_mb_after_refusals"] = peak_memory_mb(process.pid)
    with server(model, "--max-body", f"{args.prompt_mb + 1:g}MB") as (url, process):
        prompt = completion_body(model_id, prompt_of(int(args.prompt_mb * MB)))
        for path in ("/health", "/metrics"):
            results[f"{path[1:]}_while_tokenizing"] = while_running(url, path, lambda: tokenize(url, prompt))
        results["peak_memory_mb_after_tokenizing"] = peak_memory_mb(process.pid)
    print(json.dumps(results, indent=2) if args.json else
          "\n".join(f"{name}: {json.dumps(value)}" for name, value in results.items()))


@contextmanager
def server(model: Path, *flags: str):
    """A `moerun serve` process on a free port; yields (url, process) once /health is 200."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-P", "-m", "moerun", "serve", "-m", str(model),
                                "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server on port {port} did not come up")
            time.sleep(0.1)
        yield url, process
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def completion_body(model_id: str, prompt: str) -> bytes:
    return json.dumps({"model": model_id, "prompt": prompt, "max_tokens": 1}).encode()


def refuse(url: str, body: bytes, chunked: bool, pace: float | None = None) -> dict:
    """Send `body` to /v1/completions over a raw socket (paced at `pace` MB/s if given) and time
    the status line of the reply from the first byte sent."""
    host, port = url.removeprefix("http://").split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=300) as connection:
        started = time.perf_counter()
        sender = threading.Thread(target=send, args=(connection, head, body, chunked, pace), daemon=True)
        sender.start()
        reply = connection.makefile("rb")
        status = int(reply.readline().split()[1])
        refused_s = time.perf_counter() - started
        sender.join()
        sent_s = time.perf_counter() - started
    return {"status": status, "refused_s": refused_s, "body_sent_s": sent_s}


def send(connection: socket.socket, head: bytes, body: bytes, chunked: bool, pace: float | None) -> None:
    """The request; a server that closes the connection ends it early."""
    started = time.perf_counter()
    try:
        connection.sendall(head)
        for offset in range(0, len(body), CHUNK):
            piece = body[offset:offset + CHUNK]
            connection.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if pace:
                time.sleep(max(0.0, (offset + len(piece)) / (pace * MB) - (time.perf_counter() - started)))
        if chunked:
            connection.sendall(b"0\r\n\r\n")
    except OSError:
        pass


def tokenize(url: str, body: bytes) -> dict:
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=600)
    return {"status": reply.status_code, "answered_s": time.perf_counter() - started,
            "message": reply.json()["error"]["message"] if reply.status_code != 200 else ""}


def prompt_of(size: int) -> str:
    words = "The rig hums in the corner of the workshop; the experts wait. "
    return (words * (size // len(words) + 1))[:size]


def while_running(url: str, path: str, work) -> dict:
    """Run `work` in a thread and GET `path` every 20 ms until it ends: the latencies, and what `work` gave."""
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(work()), daemon=True)
    latencies = []
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        replies = connection.makefile("rb")
        get(connection, replies, path)              # the connection is open before the work starts
        worker.start()
        while worker.is_alive():
            started = time.perf_counter()
            get(connection, replies, path)
            latencies.append(time.perf_counter() - started)
            time.sleep(PROBE_INTERVAL_S)
    worker.join()
    return {"probes": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
            "max_ms": 1000 * max(latencies), "during": outcome}


def get(connection: socket.socket, replies, path: str) -> None:
    """One GET on a kept-alive raw connection, read to the end of its body (a plain socket: an
    HTTP client library adds tens of milliseconds of its own on some machines)."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    status = int(replies.readline().split()[1])
    length = 0
    while (line := replies.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    replies.read(length)
    if status != 200:
        sys.exit(f"GET {path} answered {status}")


def peak_memory_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
