"""The web side of zerolite serve: OpenAI's endpoints on FastAPI, each request handed to the
decode loop and its tokens sent back as they come (server-sent events: zerolite.serve.streaming)
or all at once.

    app = build_app(decode_loop, served, metrics, api_key="...", max_request_bytes=1 << 20, local_only=False)

The routes are module-level functions that find the server's parts in app.state; what a request
must pass before it is read (the key, the Host, the body's kind, size and time) is in
zerolite.serve.request_guards. Every error is OpenAI's shape, {"error": {"message", "type",
"param", "code"}}, with a 4xx for what the client can fix.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from zerolite.serve.decode_loop import DecodeLoop, QueueFull, ShuttingDown
from zerolite.serve.decode_loop import Request as Job
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
from zerolite.serve.request_guards import authorize, read_body
from zerolite.serve.streaming import event_stream, whole

router = APIRouter()


def build_app(decode_loop: DecodeLoop, served: ServedModel, metrics: ServeMetrics, api_key: str | None,
              max_request_bytes: int, local_only: bool) -> FastAPI:
    """local_only: the server listens on loopback without a key, so requests must name a loopback
    Host (zerolite.serve.request_guards.authorize)."""
    app = FastAPI(title="zerolite", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.decode_loop = decode_loop
    app.state.served = served
    app.state.metrics = metrics
    app.state.api_key = api_key
    app.state.max_request_bytes = max_request_bytes
    app.state.local_only = local_only
    app.add_exception_handler(BadRequest, bad_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(QueueFull, queue_full)
    app.add_middleware(CountRequests, metrics=metrics)
    app.include_router(router)
    return app


def fail(status: int, message: str, code: str | None = None, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code, param), status_code=status, headers=headers)


async def bad_request(_: Request, e: BadRequest) -> JSONResponse:
    return fail(e.status, str(e), e.code, e.param)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 404:
        return fail(404, f"no endpoint {request.url.path}: this server has /v1/models, /v1/completions, "
                         "/v1/chat/completions, /health and /metrics", "not_found")
    if e.status_code == 405:
        return fail(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
    return fail(e.status_code, str(e.detail))


async def queue_full(request: Request, e: QueueFull) -> JSONResponse:
    return fail(429, f"the server is busy ({request.app.state.decode_loop.max_queue} sequences already wait): retry "
                     f"after {e.retry_after_s} s", "queue_full", headers={"Retry-After": str(e.retry_after_s)})


def submit(decode_loop: DecodeLoop, sequences_) -> Job:
    if len(sequences_) > decode_loop.capacity:
        raise BadRequest(f"this request makes {len(sequences_)} sequences, and this server holds at most "
                         f"{decode_loop.capacity} running or waiting: ask for fewer choices", param="n")
    job = Job(sequences_, asyncio.get_running_loop())
    try:
        decode_loop.submit(job)  # QueueFull goes to its own handler
    except ShuttingDown:
        raise BadRequest("the server is shutting down: send the request elsewhere or later", 503,
                         "shutting_down") from None
    return job


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    decode_loop = request.app.state.decode_loop
    if not decode_loop.alive:
        return JSONResponse({"status": "decode loop stopped"}, status_code=503)
    if not decode_loop.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", dependencies=[Depends(authorize)])
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", dependencies=[Depends(authorize)])
async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(request.app.state.served)]})


@router.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
async def model(name: str, request: Request) -> JSONResponse:
    served = request.app.state.served
    if name != served.name:
        raise BadRequest(f"model {name!r} is not served here: this server serves {served.name!r}", 404,
                         "model_not_found")
    return JSONResponse(model_card(served))


@router.post("/v1/completions", dependencies=[Depends(authorize)])
async def completions(request: Request):
    served, decode_loop = request.app.state.served, request.app.state.decode_loop
    body = parse(CompletionRequest, await read_body(request))
    check_model(body, served)
    prompts = await run_in_threadpool(completion_prompts, body, served)  # tokenizing: off the event loop
    job = submit(decode_loop, sequences(body, prompts, served, body.max_tokens, default_max=16))
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
        return event_stream(job, decode_loop, frame, lambda i: frame(i, echoed[i], None, None) if echoed[i] else None,
                            body.usage_chunk, prompt_tokens, with_ids)
    texts, ids, reasons, failure = await whole(job, decode_loop, request)
    if failure is not None:
        return fail(failure.status, failure.message, failure.code)
    choices = [frame(i, echoed[i] + texts[i], reasons[i], ids[i])["choices"][0] for i in range(len(texts))]
    return JSONResponse({"id": ident, "object": "text_completion", "created": created, "model": served.name,
                         "choices": choices, "usage": usage(prompt_tokens, sum(map(len, ids)))})


@router.post("/v1/chat/completions", dependencies=[Depends(authorize)])
async def chat(request: Request):
    served, decode_loop = request.app.state.served, request.app.state.decode_loop
    body = parse(ChatRequest, await read_body(request))
    check_model(body, served)
    prompt = await run_in_threadpool(chat_prompt, body, served)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    job = submit(decode_loop, sequences(body, [prompt], served, asked, default_max=None))
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
        return event_stream(job, decode_loop, frame, opening, body.usage_chunk, len(prompt), body.return_token_ids)
    texts, ids, reasons, failure = await whole(job, decode_loop, request)
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


def echo_text(served: ServedModel, ids: list[int]) -> str:
    return served.tokenizer.decode(ids, skip_special_tokens=True) if served.tokenizer is not None else ""
