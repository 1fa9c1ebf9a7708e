"""zerolite serve: the model behind OpenAI's API, its clients batched into each pass over the weights."""

from __future__ import annotations

from typing import Annotated

import typer

from zerolite.cli import options
from zerolite.cli.app import app
from zerolite.cli.plan_summary import show_plan
from zerolite.cli.ranks import refuse_ranks, start_world
from zerolite.errors import ZeroliteError
from zerolite.progress import stderr


@app.command()
@options.with_load_options
def serve(
    host: Annotated[str, typer.Option(
        help="Address to listen on; beyond loopback needs --api-key (or --insecure).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ZEROLITE_API_KEY", show_envvar=True,
                                                help="Clients must send Authorization: Bearer KEY.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure",
                                           help="Allow a non-loopback --host without an API key.")] = False,
    max_batch: Annotated[str, typer.Option(
        help="Sequences per step, or auto: as many as the memory holds at the full context (up to 64).")] = "auto",
    max_queue: Annotated[int, typer.Option(
        min=0, help="Sequences that may wait for a place in the batch; past that, requests get 429 with "
        "Retry-After.")] = 256,
    step_tokens: Annotated[str, typer.Option(
        help="Tokens one step computes over the whole batch, or auto: as many as the compute takes while the step "
        "waits for its reads anyway. A longer prompt joins over several steps, so the others' tokens keep "
        "coming.")] = "auto",
    max_context: Annotated[int | None, typer.Option(
        min=2, help="Tokens per sequence, prompt and completion (default: the model's context).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        min=1, help="Completion tokens one request may ask for (default: the context).")] = None,
    max_request_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted.")] = 1 << 20,
    drain_timeout: Annotated[float, typer.Option(
        min=0, help="On SIGTERM or SIGINT: seconds for the requests in flight to finish before they are answered "
        "with an error.")] = 30.0,
    served_model_name: Annotated[str | None, typer.Option(
        help="The model id clients send (default: --model's name).")] = None,
    **load,
) -> None:
    """Serve the model over OpenAI's API: concurrent requests share each pass over the weights."""
    given = {**{k: v for k, v in locals().items() if k != "load"}, **load}
    world = start_world(given)
    world.run_on_all(lambda: refuse_ranks(world.size), "starting")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ZeroliteError("zerolite serve needs FastAPI and uvicorn: pip install 'zerolite[serve]'") from None
    from zerolite.serve.server import (
        ServeSettings,
        bind,
        build_server,
        check_exposure,
        run_server,
    )

    spec = options.to_load_spec(load)
    if spec.draft is not None or spec.draft_group_size is not None:
        raise ZeroliteError("--draft is for generate: speculative decoding runs at batch 1, and serve batches its "
                            "clients into each pass over the weights; leave out --draft")
    settings = ServeSettings(host=host, port=port, api_key=api_key or None, insecure=insecure,
                             max_batch=options.parse_batch_size(max_batch, "--max-batch", "sequences"),
                             max_queue=max_queue,
                             step_tokens=options.parse_batch_size(step_tokens, "--step-tokens", "tokens"),
                             max_context=max_context, max_tokens=max_tokens,
                             max_request_bytes=max_request_bytes, drain_timeout_s=drain_timeout,
                             served_name=served_model_name)
    check_exposure(settings)
    sock = bind(host, port)  # before loading: a port in use is found in a second, not after minutes
    with sock, options.load_model(spec) as lm:
        server = build_server(lm, settings, spec.model)
        show_plan(lm, server.decode_loop.max_batch, server.served.context)
        run_server(server, settings, sock, announce=lambda line: stderr.print(line, highlight=False, soft_wrap=True))
