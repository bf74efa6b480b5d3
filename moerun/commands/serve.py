"""`moerun serve`: the OpenAI-compatible HTTP server (docs/server.md).

The server's libraries are the `server` extra; they are imported when the command runs,
so the rest of the command line works without them.
"""
from __future__ import annotations

import errno
import logging
import socket
from functools import partial
from pathlib import Path

import click

from moerun.commands.options import (
    DEMO_DAEMONS,
    MODEL_HELP,
    friendly_errors,
    given_on_command_line,
    model_or_demo,
    open_runtime,
    runtime_options,
    speculation_options,
)
from moerun.engine.prefix_cache import PrefixCache
from moerun.units import parse_bytes

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5     # on Ctrl-C, requests still generating get this long before they are cut


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("--served-model-name", default=None,
              help="The model's id in the API [default: the file name without .gguf].")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Longest prompt a request may send, in tokens [default: the context less one].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Most tokens a request may generate; also the default max_tokens "
                   "[default: what the context leaves after the prompt].")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait behind those generating; more are refused with 503 (Retry-After).")
@click.option("--max-body", default="4MiB", show_default=True, metavar="SIZE",
              help="Largest request body, e.g. 4MiB or 500KB; larger ones are refused with 413 unread.")
@click.option("-np", "--parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests decoded together, joining as slots free (continuous batching; the CPU parent "
                   "without --split for now).")
@click.option("--prefix-cache-slots", type=click.IntRange(min=0), default=4, show_default=True,
              help="Prefix snapshots kept in RAM: a request resumes from the longest one its prompt begins "
                   "with and prefills only the rest (0: none).")
@click.option("--snapshot-interval", type=click.IntRange(min=0), default=2048, show_default=True,
              help="Also snapshot a long prompt every this many tokens, besides its end and each answer's "
                   "(0: only those).")
@click.option("--prefix-cache-dir", type=click.Path(file_okay=False), default=None,
              help="Also keep every prefix snapshot in this folder, where a restarted server finds them.")
@click.option("--prefix-cache-budget", default="8GiB", show_default=True, metavar="SIZE",
              help="Most bytes of snapshots in --prefix-cache-dir; the least used go first.")
@click.option("--api-key", multiple=True, metavar="KEY",
              help="A key clients must send, as 'Authorization: Bearer KEY' or 'x-api-key: KEY'. Repeatable; "
                   "one value may hold several, comma-separated. A key here shows in ps: prefer --api-key-file.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="A file of API keys, one a line.")
@click.option("--public-health/--private-health", default=True, show_default=True,
              help="With API keys: answer /health without one (load balancers probe it).")
@click.option("--public-metrics/--private-metrics", default=False, show_default=True,
              help="With API keys: answer /metrics without one.")
@click.option("--insecure", is_flag=True, default=False,
              help="Listen on an address other machines reach (--host) without an API key.")
@runtime_options
@friendly_errors
@speculation_options
def serve(model, host, port, served_model_name, max_prompt_tokens, max_tokens, max_queue, max_body, parallel,
          prefix_cache_slots, snapshot_interval, prefix_cache_dir, prefix_cache_budget, api_key, api_key_file,
          public_health, public_metrics, insecure, speculation, **runtime_flags):
    """Serve the OpenAI chat and completions API over HTTP, with /health and /metrics.

    Requests queue in arrival order and are served one at a time, each resuming from the longest
    prefix snapshot of its prompt, or with --parallel N up to N decoded together. Without -m,
    serves the built-in demo model with two CPU expert daemons. Without an API key the server
    listens only on this machine's loopback addresses, unless --insecure."""
    try:
        import uvicorn

        from moerun.server.app import create_app
        from moerun.server.auth import Access, is_loopback, keys_given, refuse_open_listening
        from moerun.server.worker import Limits, Worker
    except ImportError as err:
        raise click.ClickException(f"moerun serve needs the server extra ({err.name} is missing): "
                                   "pip install 'moerun[server]'") from None
    max_body_bytes = parse_bytes(max_body, "--max-body")
    if max_body_bytes < 1:
        raise click.ClickException("--max-body must be at least 1 byte")
    access = Access(keys_given(api_key, api_key_file), public_health, public_metrics)
    refuse_open_listening(host, access, insecure)
    if not access.keys and not is_loopback(host):
        logger.warning(f"--insecure: no API key, so whoever reaches --host {host} may use the server")
    if parallel > 1:
        if runtime_flags["device"] != "cpu" or runtime_flags["splits"]:
            raise click.ClickException("--parallel: requests are decoded together on the CPU parent without --split "
                                       "for now; give --parallel 1 (the default) here")
    listening = listening_socket(host, port)  # a busy port ends the command before anything loads
    if model is None:
        runtime_flags["daemons"] = runtime_flags["daemons"] or DEMO_DAEMONS
    model = model_or_demo(model)

    def stop_serving() -> None:
        server.should_exit = True

    budget = parse_bytes(prefix_cache_budget, "--prefix-cache-budget")
    if prefix_cache_dir is not None and not prefix_cache_slots:
        raise click.ClickException("--prefix-cache-dir needs --prefix-cache-slots of at least 1")
    if runtime_flags["splits"] and prefix_cache_slots:
        if given_on_command_line("prefix_cache_slots") or prefix_cache_dir is not None:
            raise click.ClickException("--split: prefix snapshots do not reach the layer shards' KV caches yet; "
                                       "drop --prefix-cache-slots and --prefix-cache-dir, or --split")
        logger.info("prefix snapshots are off with --split: the layer shards' KV caches are not snapshotted yet")
        prefix_cache_slots = 0
    prefix_cache = (PrefixCache(prefix_cache_slots, snapshot_interval, prefix_cache_dir, budget)
                    if prefix_cache_slots else None)
    model_id = served_model_name or Path(model).name.removesuffix(".gguf")

    def announce() -> None:
        logger.info(f"serving {model_id} at {url_of(listening)} (OpenAI API at /v1)")

    worker = Worker(partial(open_runtime, model, runtime_flags, prefix_cache=prefix_cache, speculation=speculation),
                    Limits(max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens, max_queue=max_queue,
                           parallel=parallel),
                    on_load_failure=stop_serving, on_ready=announce, speculation=speculation)
    app = create_app(worker, model_id, max_body_bytes, access)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    server.run(sockets=[listening])
    if worker.load_error:
        raise click.ClickException(worker.load_error)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (uvicorn accepts on it; connections wait in its backlog
    until then), or one `Error:` line saying why not."""
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                              socket.IPPROTO_TCP)     # asyncio sets TCP_NODELAY on TCP sockets only
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as err:
        listening.close()
        hint = ("another program listens there: stop it or pick another --port" if err.errno == errno.EADDRINUSE
                else "check --host and --port")
        raise click.ClickException(f"cannot listen on {host}:{port}: {err.strerror or err} ({hint})") from None
    listening.listen()
    return listening


def url_of(listening: socket.socket) -> str:
    """http://ADDRESS:PORT of a listening socket, with the port the system picked for --port 0."""
    address, port = listening.getsockname()[:2]
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
