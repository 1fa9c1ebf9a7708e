"""The options generate, profile and serve share, each declared once with one help text, and the
one way they load a model from them.

    @app.command()
    @options.with_load_options
    def profile(batch_size: ..., **load):     # load: model, offload, path, ..., draft_group_size
        spec = options.to_load_spec(load)         # a zerolite.runtime.load_spec.LoadSpec
        lm = options.load_model(spec, world=world)

Library errors name the API's parameters in backquotes (`prefetch_depth`); flag_words() words
them as this command line's flags (--prefetch-depth).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Annotated

import typer
from typer.models import ArgumentInfo

from zerolite.errors import ZeroliteError

Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="A layout folder, or a model folder / .gguf / hub id to convert under --path first "
    "(default: the built-in SmolLM2-135M-Instruct).")]
Offload = Annotated[str, typer.Option(
    help="Where the blocks live while running: nvme (stream from the layout), cpu (host memory) "
    "or none (all resident).")]
LayoutPath = Annotated[Path | None, typer.Option(
    "--path", help="Offload root, such as /nvme, holding one layout per model in a folder of its own, where --model "
    "is converted; or a layout to run (default: zerolite's cache).")]
Device = Annotated[str, typer.Option(help="cuda, cpu, or auto (cuda when available).")]
Dtype = Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 when converting (default: the config's dtype).")]
PrefetchDepth = Annotated[int | None, typer.Option(
    min=1, help="Slots in the ring: 2 reads the next block while one computes; more keep the disk reading while "
    "layers held in memory compute (default: generate takes zerolite plan's choice for the job, else 2; a --draft "
    "deepens it, so that the disk reads on while the draft guesses).", show_default=False)]
GpuMemory = Annotated[str | None, typer.Option(
    "--gpu-memory", help="Blocks to keep resident on the GPU, as 20GB or 18GiB (default: what is free, less headroom).",
    show_default=False)]
CpuMemory = Annotated[str | None, typer.Option(
    "--cpu-memory", help="Layers to keep in host memory before streaming the rest from disk, as 64GB; 0 streams every "
    "layer (default: what is free, less headroom). Under torchrun, the node's: its ranks share one copy.",
    show_default=False)]
KvOffload = Annotated[float, typer.Option(
    "--kv-offload", help="Share of the layers (0 to 1) whose K/V cache lives in host memory, so the batch can grow "
    "past device memory.")]
KvDisk = Annotated[float, typer.Option(
    "--kv-disk", help="Share of the layers (0 to 1, with --kv-offload's at most 1) whose K/V cache lives in files "
    "under the offload root (--offload nvme, or --path), read one layer ahead, so the batch can grow past host "
    "memory too.")]
KvBits = Annotated[int, typer.Option(
    "--kv-bits", help="Bits of the K/V cache, in every tier: 16 (the model's dtype), or 8 / 4, quantized in groups "
    "with their scales as they are added (4-bit keys per channel over 128 tokens, the rest token by token), so "
    "about 2x / 3.5x the sequences fit.")]
KvAttention = Annotated[str, typer.Option(
    "--kv-attention", help="Where attention over the K/V in host memory (--kv-offload) runs: device copies those "
    "layers' K/V to the GPU each step; cpu computes it on the CPU, where the K/V lives, only the query and the "
    "output crossing the link; auto takes zerolite plan's choice where generate plans the job (else device).")]
Experts = Annotated[str, typer.Option(
    "--experts", help="A mixture of experts: device (or routed) moves only the experts the router picks at each step "
    "to the device, whole moves every expert, as a dense layer streams; cpu (on a GPU) computes the routed experts on "
    "the CPU from host memory, only their tokens' hidden states crossing to the GPU and back; auto takes zerolite "
    "plan's choice where generate plans the job, per layer, from the link's and the CPU's measured rates (else "
    "device). On a CPU every choice but whole computes the routed experts where they live.")]
CpuExpertLayers = Annotated[int | None, typer.Option(
    "--cpu-expert-layers", min=0, help="With --experts cpu: how many of the layers read per expert have their "
    "experts computed on the CPU, spread among the others, whose experts go to the GPU (default: all).",
    show_default=False)]
MicroBatches = Annotated[int | None, typer.Option(
    "--micro-batches", min=1, help="Split each batch into this many micro-batches that one pass over the weights "
    "serves, prefill included: each layer, once loaded, runs every micro-batch before the next, so the device holds "
    "one micro-batch's activations and the batch is capped by the K/V and host memory (default: 1).",
    show_default=False)]
Weights = Annotated[str | None, typer.Option(
    "--weights", help="stored (the checkpoint's own precision), or int8 / int4: its layers' weights converted so, once "
    "(a quarter of the bytes to stream with int4).", show_default=False)]
AllowPickle = Annotated[bool, typer.Option(
    "--allow-pickle", help="Read pickled .bin weights when converting (weights_only=True).")]
Draft = Annotated[str | None, typer.Option(
    help="Speculative decoding at batch 1: a small model sharing the tokenizer (layout or checkpoint), or self-int4 / "
    "self-int8 (the model's own weights quantized), held resident to draft tokens the streamed model checks several "
    "at a time.")]
DraftGroupSize = Annotated[int | None, typer.Option(
    "--draft-group-size", help="self-int4: input weights per scale and zero point, as convert's --group-size (default "
    "32: the closer the draft, the more of its guesses are kept).")]

# What to load and how: fields of zerolite.runtime.load_spec.LoadSpec (zerolite.load's parameters), as options
# with their defaults.
LOAD_OPTIONS = {
    "model": (Model, None),
    "offload": (Offload, "nvme"),
    "path": (LayoutPath, None),
    "device": (Device, "auto"),
    "dtype": (Dtype, None),
    "prefetch_depth": (PrefetchDepth, None),
    "gpu_memory": (GpuMemory, None),
    "cpu_memory": (CpuMemory, None),
    "kv_offload": (KvOffload, 0.0),
    "kv_disk": (KvDisk, 0.0),
    "kv_bits": (KvBits, 16),
    "kv_attention": (KvAttention, "auto"),
    "experts": (Experts, "auto"),
    "cpu_expert_layers": (CpuExpertLayers, None),
    "micro_batches": (MicroBatches, None),
    "weights": (Weights, None),
    "allow_pickle": (AllowPickle, False),
    "draft": (Draft, None),
    "draft_group_size": (DraftGroupSize, None),
}
# Where a parameter's flag is not its name with dashes.
FLAGS = {"input_file": "--input", "as_json": "--json"}


def with_load_options(command):
    """command with the load options among its parameters (after its arguments, before its own
    options, as --help lists them): typer reads them from its signature, and command receives
    them in its **keywords."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    arguments = [p for p in own if any(isinstance(m, ArgumentInfo) for m in getattr(p.annotation, "__metadata__", ()))]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
              for name, (annotation, default) in LOAD_OPTIONS.items()]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p not in arguments]
    command.__signature__ = signature.replace(parameters=arguments + shared + rest)
    return command


def to_load_spec(load: dict):
    """The LoadSpec of the load options a command was given (sizes read, as zerolite.load reads them)."""
    from zerolite.runtime.load_spec import LoadSpec

    return LoadSpec(**load)


def load_model(spec, **more):
    """The model spec (a LoadSpec) asks for, loaded with more keywords (world, timeline, show_progress)."""
    from zerolite.lm import load_spec as load_lm

    return load_lm(spec, **more)


def flag(parameter: str) -> str:
    return FLAGS.get(parameter, "--" + parameter.replace("_", "-"))


def flag_words(message: str) -> str:
    """A library error's line as this command line says it: `max_new_tokens` is --max-new-tokens."""
    return re.sub(r"`(\w+)`", lambda m: flag(m[1]), message)


def parse_batch_size(text: str, option: str = "--batch-size", what: str = "prompts") -> int | None:
    """A whole number of prompts (or sequences) per batch, or None for auto."""
    if text.strip().lower() == "auto":
        return None
    try:
        size = int(text)
    except ValueError:
        raise ZeroliteError(f"{option} {text!r} is not a number: give a whole number of {what}, or auto") from None
    if size < 1:
        raise ZeroliteError(f"{option} must be at least 1, got {size}")
    return size
