"""What a request must pass before zerolite serve reads it: who may ask, and a body bounded in
kind, size and time. Each guard reads the server's settings from app.state (zerolite.serve.app
puts them there) and raises BadRequest, which the app answers in OpenAI's error shape.

    @router.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        raw = await read_body(request)     # JSON, at most max_request_bytes, whole within BODY_TIMEOUT_S
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets

from fastapi import Request
from starlette.requests import ClientDisconnect

from zerolite.serve.protocol import BadRequest

BODY_TIMEOUT_S = 30.0      # for a request body to arrive whole (a client that stops sending holds nothing longer)


def authorize(request: Request) -> None:
    """The API key, where the server has one. local_only (a server on loopback without a key):
    requests must name a loopback Host, so that a web page the user visits cannot reach it by DNS
    rebinding (a name of the attacker's that resolves to 127.0.0.1)."""
    state = request.app.state
    if state.local_only and not is_loopback_host(request.headers.get("host", "")):
        raise BadRequest("this server answers only requests to a loopback address (Host: 127.0.0.1, localhost "
                         "or [::1]); to serve others, start it with --api-key", 403, "forbidden_host")
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
        raise BadRequest("missing or wrong API key: send the header Authorization: Bearer KEY", 401, "invalid_api_key")


async def read_body(request: Request) -> bytes:
    """The JSON body, bounded in size and time. JSON only: a form or text/plain POST is what a web
    page can send to any address without asking first (no CORS preflight)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise BadRequest(f"the request body must be JSON, sent with Content-Type: application/json "
                         f"(not {kind or 'none'})", 415, "unsupported_media_type")
    try:
        return await asyncio.wait_for(receive_body(request, request.app.state.max_request_bytes), BODY_TIMEOUT_S)
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive whole within {BODY_TIMEOUT_S:.0f} s", 408,
                         "request_timeout") from None
    except ClientDisconnect:
        raise BadRequest("the client went away while sending the request", 400, "client_disconnected") from None


async def receive_body(request: Request, max_bytes: int) -> bytes:
    """The body's bytes, refused as soon as its declared or received length passes max_bytes."""
    declared = request.headers.get("content-length")
    too_big = BadRequest(f"the request body is over {max_bytes} bytes, this server's limit", 413, "request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise too_big
    return bytes(body)


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
