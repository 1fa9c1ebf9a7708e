"""A request's events from the decode loop, as they come: sent on as server-sent events, or gathered
into one whole answer.

    return event_stream(job, decode_loop, frame, opening, include_usage, prompt_tokens, with_ids)
    texts, ids, reasons, failure = await whole(job, decode_loop, request)

A client that goes away is cancelled: a stream's generator is closed when the connection drops,
and a whole answer's wait looks for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from zerolite.serve.decode_loop import DecodeLoop, Failed, Finished, Tokens
from zerolite.serve.decode_loop import Request as Job
from zerolite.serve.protocol import error_body, usage

DISCONNECT_POLL_S = 0.5    # how often a whole answer's wait looks for a client gone away


async def follow(job: Job, decode_loop: DecodeLoop, request: Request | None) -> AsyncIterator:
    """The job's events until every sequence finished or it failed. request given: looks for the
    client going away while waiting (a stream hears of it by being closed). Cancels the job if
    left before the end."""
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
            decode_loop.wake()


async def whole(job: Job, decode_loop: DecodeLoop,
                request: Request) -> tuple[list[str], list[list[int]], list[str | None], Failed | None]:
    """Each choice's text, token ids and finish reason once all are done, or the failure that ended them."""
    count = len(job.sequences)
    texts, ids, reasons = [""] * count, [[] for _ in range(count)], [None] * count
    async for event in follow(job, decode_loop, request):
        if isinstance(event, Tokens):
            texts[event.index] += event.text
            ids[event.index] += event.token_ids
        elif isinstance(event, Finished):
            reasons[event.index] = event.reason
        else:
            return texts, ids, reasons, event
    return texts, ids, reasons, None


def event_stream(job: Job, decode_loop: DecodeLoop, frame: Callable, opening: Callable, include_usage: bool,
                 prompt_tokens: int, with_ids: bool) -> StreamingResponse:
    """Server-sent events: frame(index, piece, reason, ids) makes one choice's chunk body;
    opening(index) the chunk each choice opens with (or None). with_ids: a token whose text is
    still held back gets a chunk too, for its id."""
    async def events():
        completion_tokens = 0
        for sequence in job.sequences:
            if (first := opening(sequence.index)) is not None:
                yield sse(first)
        async for event in follow(job, decode_loop, None):
            if isinstance(event, Tokens):
                completion_tokens += len(event.token_ids)
                if event.text or with_ids:
                    yield sse(frame(event.index, event.text, None, event.token_ids))
            elif isinstance(event, Finished):
                yield sse(frame(event.index, None, event.reason, None))
            else:
                yield sse(error_body(event.message, event.status, event.code))
                break
        else:
            if include_usage:
                last = frame(None, None, None, None)
                yield sse({**last, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
