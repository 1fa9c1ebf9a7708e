"""The web side of zerolite serve: OpenAI's endpoints on FastAPI, each request handed to the
engine loop and its tokens sent back as they come (server-sent events) or all at once.

    app = build_app(engine, served, metrics, api_key="...", max_request_bytes=1 << 20)

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx for
what the client can fix. A client that goes away is cancelled: a stream's generator is closed
when the connection drops, and a whole answer's wait looks for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from zerolite.serve.engine_loop import (
    EngineLoop,
    Failed,
    Finished,
    QueueFull,
    ShuttingDown,
    Tokens,
)
from zerolite.serve.engine_loop import Request as Job
from zerolite.serve.metrics import ServeMetrics
from zerolite.serve.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    ServedModel,
    chat_prompt,
    check_model,
    completion_prompts,
    error_body,
    model_card,
    new_id,
    now,
    parse,
    sequences,
    usage,
)

DISCONNECT_POLL_S = 0.5    # how often a whole answer's wait looks for a client gone away
BODY_TIMEOUT_S = 30.0      # for a request body to arrive whole (a client that stops sending holds nothing longer)
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "server_error",
               500: "server_error"}


def build_app(engine: EngineLoop, served: ServedModel, metrics: ServeMetrics, api_key: str | None,
              max_request_bytes: int, local_only: bool) -> FastAPI:
    """local_only: the server listens on loopback without a key, so requests must name a loopback
    Host: a web page the user visits cannot reach it by DNS rebinding (a name of the attacker's
    that resolves to 127.0.0.1)."""
    app = FastAPI(title="zerolite", docs_url=None, redoc_url=None, openapi_url=None)

    def fail(status: int, message: str, code: str | None = None, param: str | None = None, headers=None) -> JSONResponse:
        kind = ERROR_TYPES.get(status, "invalid_request_error")
        return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, e: BadRequest) -> JSONResponse:
        return fail(e.status, str(e), e.code, e.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            return fail(404, f"no endpoint {request.url.path}: this server has /v1/models, /v1/completions, "
                             "/v1/chat/completions, /health and /metrics", "not_found")
        if e.status_code == 405:
            return fail(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        return fail(e.status_code, str(e.detail))

    app.add_middleware(CountRequests, metrics=metrics)

    def authorize(request: Request) -> None:
        if local_only and not is_loopback_host(request.headers.get("host", "")):
            raise BadRequest("this server answers only requests to a loopback address (Host: 127.0.0.1, localhost "
                             "or [::1]); to serve others, start it with --api-key", 403, "forbidden_host")
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise BadRequest("missing or wrong API key: send the header Authorization: Bearer KEY", 401, "invalid_api_key")

    async def read_body(request: Request) -> bytes:
        """The JSON body, bounded in size and time. JSON only: a form or text/plain POST is what a web
        page can send to any address without asking first (no CORS preflight)."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise BadRequest(f"the request body must be JSON, sent with Content-Type: application/json "
                             f"(not {kind or 'none'})", 415, "unsupported_media_type")
        try:
            return await asyncio.wait_for(receive_body(request), BODY_TIMEOUT_S)
        except TimeoutError:
            raise BadRequest(f"the request body did not arrive whole within {BODY_TIMEOUT_S:.0f} s", 408,
                             "request_timeout") from None
        except ClientDisconnect:
            raise BadRequest("the client went away while sending the request", 400, "client_disconnected") from None

    async def receive_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_big = BadRequest(f"the request body is over {max_request_bytes} bytes, this server's limit", 413,
                             "request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise too_big
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > max_request_bytes:
                raise too_big
        return bytes(body)

    def submit(sequences_) -> Job:
        if len(sequences_) > engine.capacity:
            raise BadRequest(f"this request makes {len(sequences_)} sequences, and this server holds at most "
                             f"{engine.capacity} running or waiting: ask for fewer choices", param="n")
        job = Job(sequences_, asyncio.get_running_loop())
        try:
            engine.submit(job)  # QueueFull goes to its own handler below
        except ShuttingDown:
            raise BadRequest("the server is shutting down: send the request elsewhere or later", 503, "shutting_down") from None
        return job

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return fail(429, f"the server is busy ({engine.max_queue} sequences already wait): retry after "
                         f"{e.retry_after_s} s", "queue_full", headers={"Retry-After": str(e.retry_after_s)})

    async def follow(job: Job, request: Request | None):
        """The job's events until every sequence finished or it failed. request given: looks for
        the client going away while waiting (a stream hears of it by being closed). Cancels the
        job if left before the end."""
        left = len(job.sequences)
        looked = time.monotonic()
        try:
            while left:
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S if request else None)
                except TimeoutError:
                    event = None
                if request is not None and time.monotonic() - looked >= DISCONNECT_POLL_S:
                    looked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                yield event
                if isinstance(event, Finished):
                    left -= 1
                elif isinstance(event, Failed):
                    return
        finally:
            if left:
                job.cancel()
                engine.wake()

    async def whole(job: Job, request: Request) -> tuple[list[str], list[list[int]], list[str | None], Failed | None]:
        count = len(job.sequences)
        texts, ids, reasons = [""] * count, [[] for _ in range(count)], [None] * count
        async for event in follow(job, request):
            if isinstance(event, Tokens):
                texts[event.index] += event.text
                ids[event.index] += event.token_ids
            elif isinstance(event, Finished):
                reasons[event.index] = event.reason
            else:
                return texts, ids, reasons, event
        return texts, ids, reasons, None

    def stream(job: Job, frame, first, include_usage: bool, prompt_tokens: int, with_ids: bool):
        """Server-sent events: frame(index, piece, reason, ids) makes one choice's chunk body;
        first(index) the chunk each choice opens with (or None). with_ids: a token whose text is
        still held back gets a chunk too, for its id."""
        async def events():
            completion_tokens = 0
            for sequence in job.sequences:
                if (opening := first(sequence.index)) is not None:
                    yield sse(opening)
            async for event in follow(job, None):
                if isinstance(event, Tokens):
                    completion_tokens += len(event.token_ids)
                    if event.text or with_ids:
                        yield sse(frame(event.index, event.text, None, event.token_ids))
                elif isinstance(event, Finished):
                    yield sse(frame(event.index, None, event.reason, None))
                else:
                    yield sse(error_body(event.message, ERROR_TYPES.get(event.status, "server_error"), event.code))
                    break
            else:
                if include_usage:
                    yield sse({**frame(None, None, None, None), "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(served)]})

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def model(name: str) -> JSONResponse:
        if name != served.name:
            raise BadRequest(f"model {name!r} is not served here: this server serves {served.name!r}", 404, "model_not_found")
        return JSONResponse(model_card(served))

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        body = parse(CompletionRequest, await read_body(request))
        check_model(body, served)
        prompts = await run_in_threadpool(completion_prompts, body, served)  # tokenizing: off the event loop
        job = submit(sequences(body, prompts, served, body.max_tokens, default_max=16))
        ident, created = new_id("cmpl"), now()
        with_ids = body.return_token_ids or served.tokenizer is None  # without a tokenizer, ids are all there is
        prompt_tokens = sum(map(len, prompts))
        echoed = [echo_text(served, prompts[s.index // body.n]) if body.echo else "" for s in job.sequences]

        def frame(index, piece, reason, ids):
            choice = {"index": index, "text": piece or "", "logprobs": None, "finish_reason": reason}
            if with_ids and ids is not None:
                choice["token_ids"] = ids
            return {"id": ident, "object": "text_completion", "created": created, "model": served.name,
                    "choices": [choice]}

        if body.stream:
            return stream(job, frame, lambda i: frame(i, echoed[i], None, None) if echoed[i] else None, body.usage_chunk,
                          prompt_tokens, with_ids)
        texts, ids, reasons, failure = await whole(job, request)
        if failure is not None:
            return fail(failure.status, failure.message, failure.code)
        choices = [frame(i, echoed[i] + texts[i], reasons[i], ids[i])["choices"][0] for i in range(len(texts))]
        return JSONResponse({"id": ident, "object": "text_completion", "created": created, "model": served.name,
                             "choices": choices, "usage": usage(prompt_tokens, sum(map(len, ids)))})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: Request):
        body = parse(ChatRequest, await read_body(request))
        check_model(body, served)
        prompt = await run_in_threadpool(chat_prompt, body, served)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = submit(sequences(body, [prompt], served, asked, default_max=None))
        ident, created = new_id("chatcmpl"), now()

        def frame(index, piece, reason, ids):
            delta = {"content": piece} if piece is not None else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            if body.return_token_ids and ids is not None:
                choice["token_ids"] = ids
            chunk = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": served.name,
                     "choices": [choice]}
            if body.usage_chunk:
                chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
            return chunk

        def opening(index):
            chunk = frame(index, "", None, None)
            chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            return chunk

        if body.stream:
            return stream(job, frame, opening, body.usage_chunk, len(prompt), body.return_token_ids)
        texts, ids, reasons, failure = await whole(job, request)
        if failure is not None:
            return fail(failure.status, failure.message, failure.code)
        choices = []
        for i in range(len(texts)):
            choice = {"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
                      "finish_reason": reasons[i]}
            if body.return_token_ids:
                choice["token_ids"] = ids[i]
            choices.append(choice)
        return JSONResponse({"id": ident, "object": "chat.completion", "created": created, "model": served.name,
                             "choices": choices, "usage": usage(len(prompt), sum(map(len, ids)))})

    return app


class CountRequests:
    """Counts answers by endpoint and status (a plain ASGI middleware: FastAPI's http middleware
    would sit between a stream and the disconnect it must hear of)."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(route.path if route is not None else "other",
                                         str(status[0]) if status else "none").inc()


def is_loopback_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback: localhost, 127.x.x.x or [::1], any port."""
    if host.startswith("["):                 # [::1] or [::1]:8000
        name = host[1:host.find("]")]
    else:                                    # name or name:port (a bare IPv6 address has no port)
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return is_loopback(name)


def is_loopback(name: str) -> bool:
    """Whether a host name or address is this machine's loopback."""
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def echo_text(served: ServedModel, ids: list[int]) -> str:
    return served.tokenizer.decode(ids, skip_special_tokens=True) if served.tokenizer is not None else ""


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
