"""zerolite generate: prompts from the command line or a JSONL file, completions to stdout or a file."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zerolite.cli import options
from zerolite.cli.app import app
from zerolite.cli.plan_summary import show_plan
from zerolite.cli.ranks import RANK_ZEROS_OWN, start_world
from zerolite.errors import ZeroliteError
from zerolite.progress import stderr

if TYPE_CHECKING:
    from zerolite.runtime.load_spec import LoadSpec

DEFAULT_BATCH_SIZE = "8"


@app.command()
@options.with_load_options
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts to complete (or use --input).",
                                                        show_default=False)] = None,
    input_file: Annotated[Path | None, typer.Option(
        "--input", help='JSONL prompts: {"id", "prompt"} or {"id", "input_ids"} per line.')] = None,
    output: Annotated[Path | None, typer.Option(
        help='JSONL completions: {"id", "prompt", "completion", "token_ids", "finish_reason"} per line.')] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt, at most.")] = 64,
    batch_size: Annotated[str | None, typer.Option(
        help="Prompts per pass over the weights, or auto: zerolite plan's choice for this job, within what the "
        "memory left holds (default 8; 1 with --draft).", show_default=False)] = None,
    batching: Annotated[str | None, typer.Option(
        help="continuous: a finished prompt's place in the batch goes to the next prompt at the next step (the "
        "default where it can run: one process, no --draft); static: batch after batch, each until its last "
        "prompt ends.", show_default=False)] = None,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of greedy decoding.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 1.0,
    top_p: Annotated[float, typer.Option(
        help="Nucleus sampling: keep the likeliest tokens holding this much probability (0 < p <= 1).")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Sample among the k likeliest tokens (0: all).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the tokenizer's chat template.")] = False,
    stats_json: Annotated[Path | None, typer.Option("--stats-json",
                                                    help="Write timings, bytes read and peak memory here.")] = None,
    **load,
) -> None:
    """Generate text with a model streamed from NVMe or CPU memory (under torchrun, on every rank)."""
    given = {**{k: v for k, v in locals().items() if k != "load"}, **load}
    import json

    from zerolite.generate.job import open_job
    from zerolite.generate.prompts import prompts_from_arguments, read_prompts
    from zerolite.generate.run import check_work, generate_all
    from zerolite.runtime.batching import decide_batch_size
    from zerolite.sampling import Sampling

    world = start_world({k: v for k, v in given.items() if k not in RANK_ZEROS_OWN})
    spec = options.to_load_spec(load)
    draft = spec.draft

    def sampling() -> Sampling:
        return Sampling(max_new_tokens, sample, temperature, top_p, top_k, seed=seed, chat=chat)

    with ExitStack() as stack:
        def read() -> list:  # on rank 0 alone
            if prompts and input_file is not None:
                raise ZeroliteError("give prompts as arguments or --input FILE, not both")
            if not prompts and input_file is None:
                raise ZeroliteError('nothing to generate from: give a prompt (zerolite generate "Once upon a time") '
                                    "or --input FILE.jsonl")
            if output is not None and input_file is not None and output.resolve() == input_file.resolve():
                raise ZeroliteError(f"--output {output} is the --input file: write the completions elsewhere")
            for target in (output, stats_json):
                if target is not None and not target.parent.is_dir():
                    raise ZeroliteError(f"cannot write {target}: folder {target.parent} does not exist")
            sampling()  # its checks, before the prompts are read
            if draft is not None and batch_size not in (None, "1"):
                raise ZeroliteError("--draft runs prompts one at a time (speculative decoding is for batch 1), "
                                    f"and --batch-size is {batch_size}: leave out --batch-size, or leave out --draft "
                                    "to batch them")
            options.parse_batch_size(batch_size or DEFAULT_BATCH_SIZE)
            if batching not in (None, "continuous", "static"):
                raise ZeroliteError(f"--batching must be continuous or static, got {batching!r}")
            if batching == "continuous" and draft is not None:
                raise ZeroliteError("--draft decodes one prompt at a time through speculative decoding, which "
                                    "--batching continuous cannot: leave out --batching")
            return read_prompts(input_file) if input_file is not None else prompts_from_arguments(prompts)

        todo, done, log = open_job(world, stack, read, output)
        if output is not None and all(p.id in done for p in todo):
            if world.leads:
                stderr.print(f"every prompt already has its completion in {output}: nothing to do")
            return
        asked = options.parse_batch_size(batch_size or DEFAULT_BATCH_SIZE)
        batch = decide_batch_size(asked, drafting=draft is not None)
        if batch is not None:  # before minutes of loading (auto sizes are checked once known)
            world.run_on_all(lambda: check_work(len(todo), batch, world.size), "dealing out the batches")
        planned_batch, planned = None, None
        if (world.size == 1 and draft is None and spec.offload == "nvme"
                and None in (batch, spec.cpu_memory, spec.prefetch_depth)):
            left = [p for p in todo if p.id not in done]
            planned_batch, spec, planned = plan_the_job(spec, left, max_new_tokens, batch)
        lm = stack.enter_context(options.load_model(spec, world=world))

        def show(batch) -> None:
            if log is not None:
                log.append(batch)
                return
            for c in batch:
                if c.completion is None:
                    typer.echo(json.dumps(c.token_ids))
                else:
                    typer.echo(c.completion if chat else (c.prompt or "") + c.completion)

        def start(size: int, tokens: int) -> None:
            """Once the model loaded and the prompts passed their checks: a run that fails says only why."""
            if world.leads:
                if planned:
                    stderr.print(f"[dim]{planned}[/dim]", highlight=False, soft_wrap=True)
                show_plan(lm, size, tokens, chosen=batch is None)

        stats = generate_all(lm, todo, sampling(), batch, show, done=done, planned_batch=planned_batch, on_start=start,
                             batching=batching)
    if not world.leads:
        return
    if stats_json is not None:
        stats.write(stats_json)
    for line in stats.summary_lines(len(todo)):
        stderr.print(f"[dim]{line}[/dim]", soft_wrap=True)


def plan_the_job(spec: LoadSpec, prompts: list, new_tokens: int,
                 batch: int | None) -> tuple[int | None, LoadSpec, str | None]:
    """zerolite plan's search for this job, for what the user left open: the batch (auto), the
    host budget, the prefetch depth, and (--experts auto, a mixture on a GPU) how many layers' experts
    the CPU computes. Returns the batch it chose (None where it was given), a new LoadSpec with the
    budget, depth and experts it chose, and a line saying so. Where the planner cannot say (no
    config it can read, a model it thinks cannot fit, or a fault of its own), the defaults stand: the
    loader's own checks have the last word."""
    from zerolite.planner.for_job import choose_for_job
    from zerolite.runtime.policy import Policy

    longest = max((len(p.input_ids) if p.input_ids is not None else len(p.text or "") // 3 + 1 for p in prompts),
                  default=1)
    try:
        Policy(device=spec.device)
    except ZeroliteError:
        return None, spec, None  # the loader says what is wrong with it
    try:
        best = choose_for_job(spec, len(prompts), longest, new_tokens, batch and min(batch, len(prompts)),
                              spec.device).best
    except Exception as e:  # noqa: BLE001 - a plan is advice: whatever stops it, the run goes on with the defaults
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, spec, f"plan: none for this job ({reason}); the default budgets stand"
    c = best.candidate
    chosen = []
    if batch is None:
        chosen.append(f"batch {c.batch_size}")
    if spec.cpu_memory is None:
        spec = dataclasses.replace(spec, cpu_memory=best.cpu_memory)
        chosen.append(f"{c.host_layers} layers in host memory")
    if spec.prefetch_depth is None:
        spec = dataclasses.replace(spec, prefetch_depth=c.prefetch_depth)
        chosen.append(f"prefetch depth {c.prefetch_depth}")
    if spec.experts in (None, "auto") and best.experts is not None:
        on_cpu = best.experts != "device"
        spec = dataclasses.replace(spec, experts="cpu" if on_cpu else "device",
                                   cpu_expert_layers=c.cpu_expert_layers if best.experts == "split" else None)
        chosen.append(f"experts on the CPU in {c.cpu_expert_layers} layers" if on_cpu else "experts copied to the GPU")
    if spec.kv_attention in (None, "auto") and c.kv_offload + c.kv_disk and best.gpu_bytes:  # off a GPU
        spec = dataclasses.replace(spec, kv_attention=c.kv_attention)
        chosen.append(f"attention over the K/V off the device on the {'CPU' if c.kv_attention == 'cpu' else 'device'}")
    line = (f"plan for {len(prompts)} prompts x {new_tokens} tokens: {', '.join(chosen)} ({c.weights} weights; "
            f"predicted {best.tokens_per_s:.1f} tokens/s, {best.bottleneck}-bound, {best.fill_s:.1f} s filling memory; "
            "zerolite plan says why)")
    return (c.batch_size if batch is None else None), spec, line
