"""The `zerolite` command: convert a model into a layout, inspect or verify one, generate from it, serve it, profile it.

Every problem a user can fix ends as one line on stderr and a non-zero exit; --debug adds the
traceback.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import typer
from typer.exceptions import TyperException
from rich.table import Table

from zerolite.errors import ZeroliteError, describe
from zerolite.progress import stderr
from zerolite.dist.world import RankFailed

app = typer.Typer(
    name="zerolite",
    help="Run Hugging Face causal LMs larger than memory by streaming blocks from NVMe or CPU memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# Flags generate and profile share: where the weights and the K/V cache live.
GpuMemory = Annotated[str | None, typer.Option(
    "--gpu-memory", help="Blocks to keep resident on the GPU, as 20GB or 18GiB (default: what is free, less headroom).",
    show_default=False)]
CpuMemory = Annotated[str | None, typer.Option(
    "--cpu-memory", help="Layers to keep in host memory before streaming the rest from disk, as 64GB; 0 streams every "
    "layer (default: what is free, less headroom). Under torchrun, the node's: its ranks share one copy.", show_default=False)]
# The same, as profile and serve take them (generate's own help says more).
ModelAsForGenerate = Annotated[str | None, typer.Option(
    "--model", "-m", help="As for generate (default: the built-in model).")]
OffloadAsForGenerate = Annotated[str, typer.Option(help="nvme, cpu or none, as for generate.")]
PathAsForGenerate = Annotated[Path | None, typer.Option(
    help="As for generate: the offload root --model is converted under, or a layout.")]
DeviceAsForGenerate = Annotated[str, typer.Option(help="cuda, cpu, or auto.")]
DtypeAsForGenerate = Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 when converting.")]
PrefetchDepthAsForGenerate = Annotated[int, typer.Option(min=1, help="Slots in the ring.")]
KvOffload = Annotated[float, typer.Option(
    "--kv-offload", help="Share of the layers (0 to 1) whose K/V cache lives in host memory, so the batch can grow "
    "past device memory.")]
Experts = Annotated[str, typer.Option(
    "--experts", help="A mixture of experts: routed moves only the experts the router picks at each step, whole "
    "moves every expert, as a dense layer streams.")]


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """--debug is taken out of the arguments by main(), wherever it stands; it is declared here for --help."""


@app.command()
def convert(
    path: Annotated[Path, typer.Option("--path", help="Folder to write the layout into: a new or empty one, or a layout to bring up to date.")],
    model: Annotated[
        str | None,
        typer.Argument(help="Model folder, .gguf file, or hub id in the local cache (default: the built-in SmolLM2-135M-Instruct)."),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: the config's dtype).")] = None,
    weights: Annotated[str | None, typer.Option(help="int8 or int4: the decoder layers' Linear weights quantized, about "
                                                     "0.5x (int8, one scale per output channel) or 0.28x (int4, a scale "
                                                     "and zero point per group) of bf16's bytes per step (default: the layout's dtype).")] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="int4: input weights per scale and zero point, 32, "
                                                   "64 or 128 (default 64; 32 keeps a GGUF Q4_0/Q4_1 source's values).")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickled .bin weights (weights_only=True).")] = False,
) -> None:
    """Convert a checkpoint into an aligned layout that zerolite streams at full disk speed."""
    from zerolite.convert.writer import convert as run_convert
    from zerolite.convert.paths import builtin_gguf

    model = model or str(builtin_gguf())
    manifest = run_convert(model, path, dtype=dtype, allow_pickle=allow_pickle, weights=weights, group_size=group_size)
    kind = manifest.dtype + (f", {manifest.quantization['weights']} layer weights" if manifest.quantization else "")
    print(f"{path}: {len(manifest.blocks)} blocks, {manifest.data_bytes / 1e9:.3f} GB of {kind}")


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A layout folder written by zerolite convert.")],
    verify: Annotated[bool, typer.Option("--verify", help="Read every block and check its checksum.")] = False,
) -> None:
    """Show a layout's blocks; with --verify, read them all back and check their checksums."""
    from zerolite.io.engine import IoEngine, aligned_empty
    from zerolite.layout.folder import Layout
    from zerolite.progress import byte_progress
    from zerolite.layout.store import DiskStore

    layout = Layout.open(path)
    manifest = layout.manifest
    table = Table(title=f"{path} ({manifest.model_type}, {manifest.dtype})")
    for column in ("block", "offset", "bytes", "tensors"):
        table.add_column(column, justify="right" if column != "block" else "left")
    for block in manifest.blocks:
        table.add_row(block.name, str(block.offset), f"{block.length:,}", str(len(block.tensors)))
    typer.echo(f"{len(manifest.blocks)} blocks, {manifest.data_bytes / 1e9:.3f} GB, from {manifest.source['model']}")
    if not verify:
        stderr.print(table)
        return
    disk = DiskStore(layout, IoEngine())
    buffer = aligned_empty(max(b.length for b in manifest.blocks))
    with byte_progress("verifying", manifest.data_bytes, len(manifest.blocks)) as progress:
        for block in manifest.blocks:
            disk.read(block.name, buffer)
            progress.advance(block.length)
    typer.echo("every block matches its checksum")


@app.command()
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts to complete (or use --input).", show_default=False)] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="A layout folder, or a model folder / .gguf / hub id to convert under --path first (default: the built-in SmolLM2-135M-Instruct)."),
    ] = None,
    offload: Annotated[str, typer.Option(help="Where the blocks live while running: nvme (stream from the layout), cpu (host memory) or none (all resident).")] = "nvme",
    path: Annotated[Path | None, typer.Option(help="Offload root, such as /nvme, holding one layout per model in a folder of its own, where --model is converted; or a layout to run (default: zerolite's cache).")] = None,
    device: Annotated[str, typer.Option(help="cuda, cpu, or auto (cuda when available).")] = "auto",
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 when converting (default: the config's dtype).")] = None,
    prefetch_depth: Annotated[int, typer.Option(min=1, help="Slots in the ring: 2 reads the next block while one computes (a --draft deepens it, so that the disk reads on while the draft guesses).")] = 2,
    input_file: Annotated[Path | None, typer.Option("--input", help='JSONL prompts: {"id", "prompt"} or {"id", "input_ids"} per line.')] = None,
    output: Annotated[Path | None, typer.Option(help='JSONL completions: {"id", "prompt", "completion", "token_ids", "finish_reason"} per line.')] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt, at most.")] = 64,
    batch_size: Annotated[str | None, typer.Option(help="Prompts per pass over the weights, or auto: the largest batch the memory left holds (default 8; 1 with --draft).", show_default=False)] = None,
    gpu_memory: GpuMemory = None,
    cpu_memory: CpuMemory = None,
    kv_offload: KvOffload = 0.0,
    experts: Experts = "routed",
    draft: Annotated[str | None, typer.Option(help="Speculative decoding at batch 1: a small model sharing the tokenizer (layout or checkpoint), or self-int4 / self-int8 (the model's own weights quantized), held resident to draft tokens the streamed model checks several at a time.")] = None,
    draft_group_size: Annotated[int | None, typer.Option("--draft-group-size", help="self-int4: input weights per scale and zero point, as convert's --group-size (default 32: the closer the draft, the more of its guesses are kept).")] = None,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of greedy decoding.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling: keep the likeliest tokens holding this much probability (0 < p <= 1).")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Sample among the k likeliest tokens (0: all).")] = 50,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the tokenizer's chat template.")] = False,
    stats_json: Annotated[Path | None, typer.Option("--stats-json", help="Write timings, bytes read and peak memory here.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickled .bin weights when converting (weights_only=True).")] = False,
) -> None:
    """Generate text with a model streamed from NVMe or CPU memory (under torchrun, on every rank)."""
    arguments = {k: v for k, v in locals().items() if k not in RANK_ZEROS_OWN}
    import json

    from zerolite.lm import load
    from zerolite.convert.writer import write_atomically
    from zerolite.moe.counts import summary_line
    from zerolite.generate.run import Sampling, check_work, generate_all
    from zerolite.generate.job import open_job
    from zerolite.generate.prompts import prompts_from_arguments, read_prompts

    world = start_world(arguments)
    with ExitStack() as stack:
        def read() -> list:
            if prompts and input_file is not None:
                raise ZeroliteError("give prompts as arguments or --input FILE, not both")
            if not prompts and input_file is None:
                raise ZeroliteError('nothing to generate from: give a prompt (zerolite generate "Once upon a time") or --input FILE.jsonl')
            if output is not None and input_file is not None and output.resolve() == input_file.resolve():
                raise ZeroliteError(f"--output {output} is the --input file: write the completions elsewhere")
            for target in (output, stats_json):
                if target is not None and not target.parent.is_dir():
                    raise ZeroliteError(f"cannot write {target}: folder {target.parent} does not exist")
            Sampling(max_new_tokens, sample, temperature, top_p, top_k, seed, chat)
            if draft is not None and batch_size not in (None, "1"):
                raise ZeroliteError(f"--draft runs prompts one at a time (speculative decoding is for batch 1), and --batch-size "
                                    f"is {batch_size}: leave out --batch-size, or leave out --draft to batch them")
            parse_batch_size(batch_size or DEFAULT_BATCH_SIZE)
            return read_prompts(input_file) if input_file is not None else prompts_from_arguments(prompts)

        todo, done, log = open_job(world, stack, read, output)
        if output is not None and all(p.id in done for p in todo):
            if world.leads:
                stderr.print(f"every prompt already has its completion in {output}: nothing to do")
            return
        sampling = Sampling(max_new_tokens, sample, temperature, top_p, top_k, seed, chat)
        batch = 1 if draft is not None else parse_batch_size(batch_size or DEFAULT_BATCH_SIZE)
        if batch is not None:  # before minutes of loading (auto sizes are checked once known)
            world.each(lambda: check_work(len(todo), batch, world.size), "dealing out the batches")
        policy = dict(gpu_memory=gpu_memory, cpu_memory=cpu_memory, kv_offload=kv_offload, experts=experts)  # sizes parsed by load
        lm = stack.enter_context(load(model, offload=offload, path=path, device=device, dtype=dtype,
                                               allow_pickle=allow_pickle, prefetch_depth=prefetch_depth, draft=draft,
                                               draft_group_size=draft_group_size, world=world, **policy))

        def show(batch) -> None:
            if log is not None:
                log.append(batch)
                return
            for c in batch:
                typer.echo(((c.prompt or "") + c.completion if not chat else c.completion) if c.completion is not None else json.dumps(c.token_ids))

        stats = generate_all(lm, todo, sampling, batch, show, done=done,
                             on_start=lambda size, tokens: world.leads and show_plan(lm, size, tokens, chosen=batch is None))
    if not world.leads:
        return
    if stats_json is not None:
        write_atomically(stats_json, json.dumps(stats.to_dict(), indent=2) + "\n")
    summary = stats.to_dict()
    ranks = f" on {stats.ranks} ranks" if stats.ranks > 1 else ""
    stderr.print(
        f"[dim]{stats.new_tokens} new tokens for {len(todo)} prompt{'s' if len(todo) != 1 else ''}{ranks}; prefill {stats.prefill_s:.2f} s, decode "
        f"{stats.decode_s:.2f} s ({summary['decode_tokens_per_s'] or 0:.1f} tokens/s{' in all' if ranks else ''}), "
        f"{stats.bytes_read / 1e9:.2f} GB read[/dim]",
        soft_wrap=True,
    )
    if stats.experts is not None:
        stderr.print(f"[dim]{summary_line(summary)}[/dim]", soft_wrap=True)
    if stats.speculation is not None and stats.speculation.drafted:
        spec = stats.speculation
        stderr.print(f"[dim]draft: {spec.accepted} of {spec.drafted} guesses kept ({summary['acceptance_rate']:.0%}), "
                     f"{summary['tokens_per_pass']:.2f} tokens per pass over the weights; {spec.draft_s:.2f} s drafting, "
                     f"{spec.target_s:.2f} s in the model's passes[/dim]", soft_wrap=True)


@app.command()
def profile(
    model: ModelAsForGenerate = None,
    offload: OffloadAsForGenerate = "nvme",
    path: PathAsForGenerate = None,
    device: DeviceAsForGenerate = "auto",
    dtype: DtypeAsForGenerate = None,
    prefetch_depth: PrefetchDepthAsForGenerate = 2,
    gpu_memory: GpuMemory = None,
    cpu_memory: CpuMemory = None,
    kv_offload: KvOffload = 0.0,
    experts: Experts = "routed",
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per step.")] = 1,
    new_tokens: Annotated[int, typer.Option(min=2, help="Steps to run: one prefill, the rest decode.")] = 8,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Length of the random prompts.")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    trace: Annotated[Path | None, typer.Option(help="Write a Chrome trace (open it in Perfetto).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Draw the timeline of the last steps into a PNG (needs matplotlib).")] = None,
    disk: Annotated[Path | None, typer.Option(help="Only measure the read bandwidth of this layout, file or folder.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickled .bin weights when converting.")] = False,
    draft: Annotated[str | None, typer.Option(help="As for generate: speculative decoding at batch 1, its guesses on a track of their own.")] = None,
    draft_group_size: Annotated[int | None, typer.Option("--draft-group-size", help="As for generate.")] = None,
) -> None:
    """Show where each step's time goes and what limits it: disk, copies, compute or prefetch (under
    torchrun: every rank at once, reported per rank and in total; rank 0 writes --trace and --plot)."""
    arguments = dict(locals())
    import json

    for target in (trace, plot):
        if target is not None and not target.parent.is_dir():
            raise ZeroliteError(f"cannot write {target}: folder {target.parent} does not exist")
    if disk is not None:
        from zerolite.profile.machine import measure_disk

        figures = measure_disk(disk)
        if as_json:
            typer.echo(json.dumps(figures))
        else:
            typer.echo(f"{figures['file']}: {figures['read_gbps']:.2f} GB/s sequential O_DIRECT reads "
                       f"({figures['bytes'] / 1e9:.2f} GB in {figures['seconds']:.2f} s, {figures['backend']})")
        return

    from zerolite.lm import load
    from zerolite.profile.run import profile_run
    from zerolite.runtime.timeline import Timeline
    from zerolite.profile.trace import plot_timeline, write_trace

    if draft is not None and batch_size != 1:
        raise ZeroliteError(f"--draft profiles speculative decoding, which runs at batch 1, and --batch-size is {batch_size}: "
                            "leave out --batch-size, or leave out --draft")
    world = start_world(arguments)
    timeline = Timeline()
    policy = dict(gpu_memory=gpu_memory, cpu_memory=cpu_memory, kv_offload=kv_offload, experts=experts)  # sizes parsed by load
    with load(model, offload=offload, path=path, device=device, dtype=dtype, allow_pickle=allow_pickle,
                       prefetch_depth=prefetch_depth, timeline=timeline, show_progress=not as_json, draft=draft,
                       draft_group_size=draft_group_size, world=world, **policy) as lm:
        if not as_json and world.leads:
            show_plan(lm, batch_size, prompt_tokens + new_tokens)
        report = profile_run(lm, timeline, batch_size, new_tokens, prompt_tokens)
        every = world.together(lambda: report.to_dict(), "profiling")
    if not world.leads:
        return
    if trace is not None:
        write_trace(timeline, trace)
    if plot is not None:
        plot_timeline(timeline, plot, report.verdict,
                      f"{offload} offload, depth {prefetch_depth}, batch {batch_size}, {report.decode_step_s * 1e3:.0f} ms per decode step")
    if world.distributed:
        totals = rank_totals(every)
        if as_json:
            typer.echo(json.dumps({"ranks": every, "total": totals}, indent=2))
        else:
            show_rank_reports(every, totals)
    elif as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        show_report(report)


@app.command()
def serve(
    model: ModelAsForGenerate = None,
    offload: OffloadAsForGenerate = "nvme",
    path: PathAsForGenerate = None,
    device: DeviceAsForGenerate = "auto",
    dtype: DtypeAsForGenerate = None,
    prefetch_depth: PrefetchDepthAsForGenerate = 2,
    gpu_memory: GpuMemory = None,
    cpu_memory: CpuMemory = None,
    kv_offload: KvOffload = 0.0,
    experts: Experts = "routed",
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickled .bin weights when converting.")] = False,
    draft: Annotated[str | None, typer.Option(help="Not for serve: speculative decoding runs at batch 1, and the server batches its clients.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; beyond loopback needs --api-key (or --insecure).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ZEROLITE_API_KEY", show_envvar=True,
                                                help="Clients must send Authorization: Bearer KEY.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow a non-loopback --host without an API key.")] = False,
    max_batch: Annotated[str, typer.Option(help="Sequences per step, or auto: as many as the memory holds at the full context (up to 64).")] = "auto",
    max_queue: Annotated[int, typer.Option(min=0, help="Sequences that may wait for a place in the batch; past that, requests get 429 with Retry-After.")] = 256,
    step_tokens: Annotated[str, typer.Option(help="Tokens one step computes over the whole batch, or auto: as many as the compute takes while the step waits for its reads anyway. A longer prompt joins over several steps, so the others' tokens keep coming.")] = "auto",
    max_context: Annotated[int | None, typer.Option(min=2, help="Tokens per sequence, prompt and completion (default: the model's context).")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Completion tokens one request may ask for (default: the context).")] = None,
    max_request_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted.")] = 1 << 20,
    drain_timeout: Annotated[float, typer.Option(min=0, help="On SIGTERM or SIGINT: seconds for the requests in flight to finish before they are answered with an error.")] = 30.0,
    served_model_name: Annotated[str | None, typer.Option(help="The model id clients send (default: --model's name).")] = None,
) -> None:
    """Serve the model over OpenAI's API: concurrent requests share each pass over the weights."""
    world = start_world(dict(locals()))
    world.each(lambda: refuse_ranks(world.size), "starting")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ZeroliteError("zerolite serve needs FastAPI and uvicorn: pip install 'zerolite[serve]'") from None
    from zerolite.lm import load
    from zerolite.serve.server import ServeSettings, bind, build_server, check_exposure, run_server

    if draft is not None:
        raise ZeroliteError("--draft is for generate: speculative decoding runs at batch 1, and serve batches its "
                            "clients into each pass over the weights; leave out --draft")
    settings = ServeSettings(host=host, port=port, api_key=api_key or None, insecure=insecure,
                             max_batch=parse_batch_size(max_batch, "--max-batch", "sequences"), max_queue=max_queue,
                             step_tokens=parse_batch_size(step_tokens, "--step-tokens", "tokens"), max_context=max_context, max_tokens=max_tokens,
                             max_request_bytes=max_request_bytes, drain_timeout_s=drain_timeout,
                             served_name=served_model_name)
    check_exposure(settings)
    sock = bind(host, port)  # before loading: a port in use is found in a second, not after minutes
    policy = dict(gpu_memory=gpu_memory, cpu_memory=cpu_memory, kv_offload=kv_offload, experts=experts)  # sizes parsed by load
    with sock, load(model, offload=offload, path=path, device=device, dtype=dtype, allow_pickle=allow_pickle,
                             prefetch_depth=prefetch_depth, **policy) as lm:
        server = build_server(lm, settings, model)
        show_plan(lm, server.engine.max_batch, server.served.context)
        run_server(server, settings, sock, announce=lambda line: stderr.print(line, highlight=False, soft_wrap=True))


DEFAULT_BATCH_SIZE = "8"
# What rank 0 alone reads and writes under torchrun: the other ranks' values of these are not used.
RANK_ZEROS_OWN = ("input_file", "output", "stats_json")


def start_world(arguments: dict):
    """The ranks of this job (one without torchrun), once each has checked that every rank was
    given the arguments rank 0 was."""
    from zerolite.dist.world import World

    world = World.from_env()
    world.start()
    given = world.together(lambda: arguments, "starting")
    world.each(lambda: same_arguments(given), "checking the arguments")
    return world


def refuse_ranks(ranks: int) -> None:
    if ranks > 1:
        raise ZeroliteError(f"zerolite serve runs as one process, and torchrun started {ranks}: start it without torchrun "
                            "(the server batches its clients into each pass over the weights itself)")


def same_arguments(given: list[dict]) -> None:
    for rank, arguments in enumerate(given):
        differ = [name for name in arguments if arguments[name] != given[0][name]]
        if differ:
            name = differ[0]
            raise ZeroliteError(f"rank {rank} was started with --{name.replace('_', '-')} {arguments[name]!r}, rank 0 with "
                                f"{given[0][name]!r}: give every node the same zerolite command")


def parse_batch_size(text: str, flag: str = "--batch-size", what: str = "prompts") -> int | None:
    """A whole number of prompts (or sequences) per batch, or None for auto."""
    if text.strip().lower() == "auto":
        return None
    try:
        size = int(text)
    except ValueError:
        raise ZeroliteError(f"{flag} {text!r} is not a number: give a whole number of {what}, or auto") from None
    if size < 1:
        raise ZeroliteError(f"{flag} must be at least 1, got {size}")
    return size


def show_plan(lm, batch_size: int, tokens: int, chosen: bool = False) -> None:
    """Where every block and the K/V cache live, and what a step must move, before anything runs."""
    from zerolite.cli.plan_summary import summarize

    lines = summarize(lm, batch_size, tokens)
    if chosen:
        lines.append(f"batch size: {batch_size} (auto: the largest that fits)")
    for line in lines:
        stderr.print(f"[dim]{line}[/dim]", highlight=False, soft_wrap=True)


def rank_totals(every: list[dict]) -> dict:
    """A torchrun profile's job: tokens/s and read rates add up over ranks running at once."""
    return {
        "ranks": len(every),
        "decode_tokens_per_s": sum(r["batch_size"] / r["decode_step_s"] for r in every),
        "streamed_bytes_per_step": sum(r["streamed_bytes_per_step"] for r in every),
        "achieved_read_gbps": sum(r["achieved_read_gbps"] or 0 for r in every) or None,
        "read_gbps": sum(r["read_gbps"] or 0 for r in every) or None,
    }


def show_rank_reports(every: list[dict], totals: dict) -> None:
    """One row per rank, then the job's totals, and each rank's verdict."""
    from rich.console import Console

    first = every[0]
    table = Table(title=f"zerolite profile: {first['offload']} offload, {len(every)} ranks, depth {first['prefetch_depth']}, "
                        f"batch {first['batch_size']} each")
    for column in ("rank", "device", "decode step", "tokens/s", "streamed per step", "achieved read", "read-only pass", "limited by"):
        table.add_column(column, justify="left" if column in ("device", "limited by") else "right")

    def rate(gbps):
        return f"{gbps:.2f} GB/s" if gbps else "-"

    for rank, r in enumerate(every):
        table.add_row(str(rank), r["device"], f"{r['decode_step_s'] * 1e3:.1f} ms", f"{r['batch_size'] / r['decode_step_s']:.1f}",
                      f"{r['streamed_bytes_per_step'] / 1e9:.3f} GB", rate(r["achieved_read_gbps"]), rate(r["read_gbps"]),
                      r["bottleneck"])
    table.add_row("all", "", "", f"{totals['decode_tokens_per_s']:.1f}", f"{totals['streamed_bytes_per_step'] / 1e9:.3f} GB",
                  rate(totals["achieved_read_gbps"]), rate(totals["read_gbps"]), "", style="bold")
    out = Console()
    out.print(table)
    for rank, r in enumerate(every):
        out.print(f"rank {rank}: {r['verdict']}")


def show_report(report) -> None:
    from rich.console import Console

    table = Table(title=f"zerolite profile: {report.offload} offload on {report.device}, depth {report.prefetch_depth}, batch {report.batch_size}")
    table.add_column("measure")
    table.add_column("value", justify="right")

    def rate(gbps):
        return f"{gbps:.2f} GB/s" if gbps is not None else "-"

    rows = [
        ("disk read bandwidth (read-only pass of the streamed blocks)", rate(report.read_gbps)),
        ("host-to-device bandwidth (measured)", rate(report.h2d_gbps)),
        ("prefill step", f"{report.prefill_s * 1e3:.1f} ms"),
        ("  compute per token (decode's per sequence)",
         f"{report.prefill_compute_per_token_s * 1e3:.2f} ms ({report.decode_compute_per_token_s * 1e3:.2f} ms)"
         + (" slow" if report.slow_prefill else "")),
        ("decode step (median)", f"{report.decode_step_s * 1e3:.1f} ms"),
        ("  compute waiting for bytes", f"{report.wait_s * 1e3:.1f} ms"),
        ("  compute", f"{report.compute_s * 1e3:.1f} ms"),
        ("  I/O at the read-only pass's rate" if report.read_gbps else "  I/O at the measured bandwidth", f"{report.io_s * 1e3:.1f} ms"),
        ("streamed per step", f"{report.streamed_bytes_per_step / 1e9:.3f} GB"),
        ("achieved read rate", rate(report.achieved_read_gbps)),
        ("share of the bound", f"{report.share_of_bound:.0%}"),
        ("overlap (step / max(I/O, compute))", f"{report.overlap:.2f}"),
        ("transfers in flight", f"{report.link_busy:.0%} of the step, {report.in_flight_bytes / 1e6:.0f} MB on average"),
    ]
    if (experts := report.experts) is not None:
        rows += [
            ("  of it dense parts / experts", f"{experts['dense_bytes_per_step'] / 1e9:.3f} GB / "
                                              f"{experts['expert_bytes_per_step'] / 1e9:.3f} GB"),
            ("  expert cache hits", "-" if experts["expert_cache_hit_rate"] is None else f"{experts['expert_cache_hit_rate']:.0%}"),
            ("  next-layer expert guesses routed to", "-" if experts["prefetch_guess_rate"] is None else f"{experts['prefetch_guess_rate']:.0%}"),
        ]
    if (spec := report.speculation) is not None:
        rows += [
            ("draft: guesses kept", f"{spec['accepted_tokens']} of {spec['draft_tokens']} ({spec['acceptance_rate'] or 0:.0%})"),
            ("  tokens per pass over the weights", f"{spec['tokens_per_pass'] or 0:.2f}"),
            ("  time drafting / in the model's passes", f"{spec['draft_s']:.2f} s / {spec['target_s']:.2f} s"),
        ]
    for row in rows:
        table.add_row(*row)
    out = Console()
    out.print(table)
    out.print(f"[bold]{report.verdict}[/bold]")
    for advice in report.advice:
        out.print(f"  - {advice}")


def main() -> None:
    # transformers draws raw tqdm bars (GGUF dequantization) that no logging switch silences; tqdm
    # reads this when it is first imported, which the lazy imports in the commands come after.
    os.environ.setdefault("TQDM_DISABLE", "1")
    argv = sys.argv[1:]
    debug = "--debug" in argv
    try:
        code = app(args=[a for a in argv if a != "--debug"], standalone_mode=False)
    except RankFailed as e:  # every rank raised it; rank 0 says it
        if e.printer:
            print(f"zerolite: error: {e}", file=sys.stderr, flush=True)
        e.part_ways()
        sys.exit(1)
    except ZeroliteError as e:
        fail(str(e), debug)
    except TyperException as e:  # usage errors: a missing argument, a bad option value
        fail(f"{e.format_message()} (see zerolite --help)", debug, code=2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        fail("interrupted", debug, code=130)
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        fail(f"internal error: {describe(e)} (rerun with --debug for the traceback)", debug)
    sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, debug: bool, code: int = 1) -> None:
    if debug:
        import traceback

        traceback.print_exc()
    print(f"zerolite: error: {message}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
