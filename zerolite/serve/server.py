"""zerolite serve: a loaded model behind OpenAI's API, until SIGTERM or SIGINT.

    server = build_server(lm, settings, model="bigscience/bloom")
    run_server(server, settings, bind(settings.host, settings.port))

The socket is bound before anything else starts, so a port in use is one clear error. On SIGTERM
or SIGINT the server stops accepting connections and requests, what is in flight has
drain_timeout_s to finish and is then answered with an error, and the decode loop and the model
are released; a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from zerolite.decoding.running_batch import cache_columns_limit
from zerolite.decoding.step_budget import START as STEP_BUDGET_START
from zerolite.errors import ZeroliteError
from zerolite.runtime.batching import decide_batch_size, largest_batch
from zerolite.serve.app import build_app
from zerolite.serve.decode_loop import DecodeLoop
from zerolite.serve.metrics import ServeMetrics
from zerolite.serve.protocol import ServedModel
from zerolite.serve.request_guards import is_loopback
from zerolite.text import context_length, end_token_ids

AUTO_BATCH_CAP = 64            # --max-batch auto: no more rows than this, whatever the memory holds
DEFAULT_CONTEXT = 2048         # for a model whose config names no context length (BLOOM's ALiBi)
GRACE_S = 5.0                  # after the drain: time for the last answers to reach their clients


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    insecure: bool = False            # a non-loopback host without an API key, on purpose
    max_batch: int | None = None      # None: auto, what the memory holds
    max_queue: int = 256              # sequences that may wait beyond the batch's free places
    step_tokens: int | None = None    # tokens one step computes over the whole batch (bounds prefill chunks);
                                      # None: as many as hide under the step's reads (zerolite.decoding.step_budget)
    max_context: int | None = None    # tokens per sequence (default: the model's context)
    max_tokens: int | None = None     # completion tokens per request (default: the context)
    max_request_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    served_name: str | None = None


def check_exposure(settings: ServeSettings) -> None:
    """Refuses to listen beyond loopback with no API key, unless told so with --insecure."""
    if is_loopback(settings.host) or settings.api_key or settings.insecure:
        return
    raise ZeroliteError(f"`host` {settings.host} listens beyond this machine, and there is no `api_key`: give one "
                        "(or ZEROLITE_API_KEY), or `insecure` if everyone who can reach the port may use the model")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ZeroliteError(f"port {port} on {host} is in use: stop what listens there, "
                                "or choose another `port`") from None
        raise ZeroliteError(f"cannot listen on {host}:{port} ({e.strerror}): check `host` and `port`") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def served_model(lm, settings: ServeSettings, model: str | None) -> ServedModel:
    config = lm.model.config.get_text_config()
    context = min(filter(None, (settings.max_context, context_length(lm.config) or DEFAULT_CONTEXT)))
    window = cache_columns_limit(lm.new_cache())
    if window is not None and window < context:
        print(f"zerolite: serving at most {window} tokens per sequence: the model's sliding window", file=sys.stderr)
        context = window
    return ServedModel(
        name=settings.served_name or default_name(model),
        tokenizer=lm.tokenizer,
        vocab_size=config.vocab_size,
        eos_ids=end_token_ids(lm.generation_config),
        context=context,
        max_tokens=min(settings.max_tokens or context, context),
        max_prompt_tokens=context - 1,
        created=int(time.time()),
    )


def default_name(model: str | None) -> str:
    """The id clients send as "model": the hub id as given, a local folder's or file's name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    local = Path(model).expanduser()
    return local.name.removesuffix(".gguf") if local.exists() else model


def auto_batch(lm, served: ServedModel, step_tokens: int | None) -> int:
    """The most rows whose K/V, each at the full context, fit the memory the weights left."""
    chunk = min(step_tokens or STEP_BUDGET_START, served.context)
    return largest_batch(lm, [chunk] * AUTO_BATCH_CAP, max(served.context - chunk, 0))


def run_server(server: DrainingServer, settings: ServeSettings, sock: socket.socket, announce=print) -> None:
    """Serves until a signal, then drains (see the module's docstring)."""
    server.decode_loop.start()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    announce(f"zerolite serve: {server.served.name} on http://{host}:{sock.getsockname()[1]}/v1 "
             f"(up to {server.decode_loop.max_batch} sequences per step, {server.served.context} tokens each)")
    try:
        server.run(sockets=[sock])
    finally:
        server.decode_loop.close()


def build_server(lm, settings: ServeSettings, model: str | None) -> DrainingServer:
    """The server, its decode loop not started yet."""
    served = served_model(lm, settings, model)
    max_batch = decide_batch_size(settings.max_batch, planned=AUTO_BATCH_CAP,
                                  fits=lambda: auto_batch(lm, served, settings.step_tokens))
    metrics = ServeMetrics(lambda: lm.bytes_read)
    decode_loop = DecodeLoop(lm, max_batch, settings.max_queue, settings.step_tokens, metrics)
    local_only = settings.api_key is None and not settings.insecure
    app = build_app(decode_loop, served, metrics, settings.api_key, settings.max_request_bytes, local_only)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(settings.drain_timeout_s + GRACE_S),
                            lifespan="off")
    return DrainingServer(config, decode_loop, served, settings.drain_timeout_s)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit on a signal first tells the decode loop to drain."""

    def __init__(self, config: uvicorn.Config, decode_loop: DecodeLoop, served: ServedModel, drain_timeout_s: float):
        super().__init__(config)
        self.decode_loop = decode_loop
        self.served = served
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal, of either kind: stop now (uvicorn's own does so for SIGINT only)
        self.decode_loop.drain(self.drain_timeout_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """As uvicorn's, less its raising the signal again once shut down: that would kill the
        process before the decode loop and the model are released. zerolite exits normally instead."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
