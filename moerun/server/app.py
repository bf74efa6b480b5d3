"""The ASGI app: OpenAI's chat and text completions (whole or streamed as server-sent events),
the model list, /health and /metrics. Every refusal is an OpenAI error body with a 4xx or 503
status; nothing answers with a traceback.

With API keys (auth.py), a request without a valid one gets 401 before anything else happens.

The event loop only moves bytes: a body over --max-body is refused before it is read, and
parsing, chat templates and tokenization run in threads (at most PREPARING_AT_ONCE requests at
a time, which bounds the memory big prompts take), so /health and /metrics answer at once
whatever the other requests are."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moerun.server.auth import Access, RequireApiKey
from moerun.server.responses import Reply, model_list
from moerun.server.schemas import ApiError, Generation, parse_chat, parse_completion
from moerun.server.worker import Failed, Finished, Job, Piece, Worker

PREPARING_AT_ONCE = 2          # requests parsed and tokenized at the same time; the others wait their turn
T = TypeVar("T")


def create_app(worker: Worker, model_id: str, max_body: int, access: Access = Access()) -> Starlette:
    """The app serves `worker` under the name `model_id`, to the requests `access` lets through,
    and refuses request bodies over `max_body` bytes; it starts the worker and stops it on shutdown."""
    @asynccontextmanager
    async def lifespan(app: Starlette):
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)

    rejected = worker.metrics.requests.labels("rejected")
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(RequireApiKey, access=access, on_refusal=rejected.inc)] if access.keys else [],
        exception_handlers={ApiError: refused, HTTPException: http_error, Exception: internal_error},
    )
    app.state.worker = worker
    app.state.model_id = model_id
    app.state.created = int(time.time())
    app.state.max_body = max_body
    app.state.preparing = anyio.CapacityLimiter(PREPARING_AT_ONCE)
    return app


async def chat_completions(request: Request) -> Response:
    body = await read_body(request)
    chat = await off_loop(request, lambda: parse_chat(json_value(body)))
    worker: Worker = request.app.state.worker
    return await complete(request, chat.generation, partial(worker.chat_prompt, chat.messages), chat=True)


async def completions(request: Request) -> Response:
    body = await read_body(request)
    completion = await off_loop(request, lambda: parse_completion(json_value(body)))
    worker: Worker = request.app.state.worker
    return await complete(request, completion.generation, partial(worker.text_prompt, completion.prompt), chat=False)


async def complete(request: Request, generation: Generation, prompt_ids: Callable[[], list[int]],
                   chat: bool) -> Response:
    """Queue the request and answer it whole or as a stream of chunks."""
    model_id = request.app.state.model_id
    if generation.model not in (None, model_id):
        raise ApiError(404, f"the model '{generation.model}' does not exist; this server runs '{model_id}'",
                       param="model", code="model_not_found")
    worker: Worker = request.app.state.worker
    job = worker.submit(await off_loop(request, prompt_ids), generation)
    reply = Reply(model_id, chat)
    if generation.stream:
        return StreamingResponse(event_stream(job, reply, generation.include_usage), media_type="text/event-stream")
    return await whole_reply(request, job, reply)


async def whole_reply(request: Request, job: Job, reply: Reply) -> Response:
    """Wait for the whole text, or for the client to hang up (which cancels the job). When the
    server stops before the text is done, it cancels this handler: the client gets a 503."""
    collecting = asyncio.ensure_future(collect(job))
    hanging_up = asyncio.ensure_future(client_gone(request))
    try:
        done, _ = await asyncio.wait({collecting, hanging_up}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        return error_response(ApiError(503, "the server is shutting down", type="server_error", code="shutting_down"))
    finally:
        hanging_up.cancel()
        if not collecting.done():
            collecting.cancel()
            job.cancel()
    if collecting not in done:
        return Response(status_code=499)           # nobody reads it: the client is gone
    result = collecting.result()
    if isinstance(result, ApiError):
        return error_response(result)
    text, finished = result
    return JSONResponse(reply.whole(text, finished))


async def collect(job: Job) -> tuple[str, Finished] | ApiError:
    pieces = []
    async for event in job.events():
        if isinstance(event, Piece):
            pieces.append(event.text)
        elif isinstance(event, Failed):
            return event.error
        else:
            return "".join(pieces), event


async def client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def event_stream(job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: chunks, the finish reason, the usage if asked, then [DONE]. The
    response stops this generator when the client disconnects, which cancels the job."""
    try:
        first = reply.first_chunk()
        if first is not None:
            yield sse(first)
        async for event in job.events():
            if isinstance(event, Piece):
                yield sse(reply.text_chunk(event.text))
            elif isinstance(event, Failed):
                yield sse(event.error.body())
                return
            else:
                yield sse(reply.last_chunk(event))
                if include_usage:
                    yield sse(reply.usage_chunk(event))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to be over --max-body: by its
    Content-Length before any of it is read, else (chunked) once the bytes read pass the limit.
    What the client still sends after a refusal is dropped as it arrives."""
    limit = request.app.state.max_body
    declared = request.headers.get("content-length")       # the HTTP parser has checked it is a number
    if declared is not None and int(declared) > limit:
        raise body_too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(f"over {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size}; this server accepts at most {limit} bytes (--max-body)",
                    code="request_too_large")


def json_value(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None


async def off_loop(request: Request, work: Callable[[], T]) -> T:
    """Run `work` in a thread, PREPARING_AT_ONCE requests at a time, so the event loop stays free."""
    return await anyio.to_thread.run_sync(work, limiter=request.app.state.preparing)


async def models(request: Request) -> Response:
    return JSONResponse(model_list(request.app.state.model_id, request.app.state.created))


async def model(request: Request) -> Response:
    listing = model_list(request.app.state.model_id, request.app.state.created)["data"][0]
    if request.path_params["model_id"] != listing["id"]:
        raise ApiError(404, f"the model '{request.path_params['model_id']}' does not exist", code="model_not_found")
    return JSONResponse(listing)


async def health(request: Request) -> Response:
    worker: Worker = request.app.state.worker
    if worker.ready:
        return JSONResponse({"status": "ok"})
    if worker.load_error:
        return JSONResponse({"status": "error", "message": worker.load_error}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503)


async def metrics(request: Request) -> Response:
    return Response(request.app.state.worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def refused(request: Request, error: ApiError) -> Response:
    request.app.state.worker.metrics.requests.labels("rejected").inc()
    return error_response(error)


async def http_error(request: Request, error: HTTPException) -> Response:
    return await refused(request, ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}"))


async def internal_error(request: Request, error: Exception) -> Response:
    """A bug: the client gets a plain message, the traceback goes to the server's log."""
    return error_response(ApiError(500, "the server failed to handle the request", type="server_error"))
