"""zerolite plan: the policy to run a model with on a machine, chosen and predicted before any weight is read."""

from __future__ import annotations

import json
import math
from typing import Annotated

import typer

from zerolite.cli.app import app
from zerolite.cli.options import CpuExpertLayers, CpuMemory, GpuMemory, LayoutPath, Model, parse_batch_size
from zerolite.errors import ZeroliteError


def rate_option(flag: str, help: str):
    return Annotated[str | None, typer.Option(flag, help=help, show_default=False)]


DiskGbps = rate_option(
    "--disk-gbps", "The disk's read rate, as 5.6GB/s (default: as zerolite profile last measured it here).")
H2dGbps = rate_option("--h2d-gbps", "Host-to-GPU copies, as 25GB/s (default: measured here).")
GpuTflops = rate_option(
    "--gpu-tflops", "The GPU's dense matmul rate in its dtype, as 77TFLOPS (default: this machine's, measured).")
CpuGbps = rate_option(
    "--cpu-gbps", "The CPU's rate for a mixture's experts on a GPU machine: the weight bytes its matmuls stream at "
    "batch 1, as 300GB/s (default: this machine's CPU, measured).")
GpuGbps = rate_option(
    "--gpu-gbps", "A described GPU's memory bandwidth, as 320GB/s: a small batch's matmuls wait on it, and "
    "dequantising weights and reading the K/V run at it (default: none counted).")
CpuTflops = rate_option(
    "--cpu-tflops", "The CPU's matmul rate at a large batch in the model's dtype, as 5TFLOPS (default: this "
    "machine's CPU, measured).")


@app.command()
def plan(
    model: Model = None,
    path: LayoutPath = None,
    device: Annotated[str, typer.Option(
        help="Plan for this machine's cuda or cpu (auto: cuda when available); a machine described by the flags below "
        "has a GPU when given --gpu-ram or --gpu-tflops.")] = "auto",
    dtype: Annotated[str | None, typer.Option(
        help="bf16, fp16 or fp32: the precision stored weights run in (default: the config's).")] = None,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Tokens in each prompt.")] = 128,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 64,
    prompts: Annotated[int | None, typer.Option(
        min=1, help="Prompts in the job (default: one batch's): filling memory is paid once per job.",
        show_default=False)] = None,
    latency: Annotated[bool, typer.Option(
        "--latency", help="Optimise each prompt's time, not tokens per second (batch 1).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the chosen plan as one JSON object.")] = False,
    batch_size: Annotated[str, typer.Option(help="Pin the batch size, or auto to search it.")] = "auto",
    weights: Annotated[str | None, typer.Option(
        help="Pin the weight format: stored (the checkpoint's precision), int8 or int4.", show_default=False)] = None,
    offload: Annotated[str | None, typer.Option(
        help="Pin where layers live: nvme (host memory, then disk), cpu (all in host memory) or none (all resident).",
        show_default=False)] = None,
    kv_offload: Annotated[float | None, typer.Option(
        "--kv-offload", help="Pin the share of layers whose K/V cache lives in host memory (GPU).",
        show_default=False)] = None,
    kv_disk: Annotated[float | None, typer.Option(
        "--kv-disk", help="Pin the share of layers whose K/V cache lives on disk.", show_default=False)] = None,
    kv_bits: Annotated[int | None, typer.Option(
        "--kv-bits", help="Pin the K/V cache's bits: 16, 8 or 4.", show_default=False)] = None,
    kv_attention: Annotated[str, typer.Option(
        "--kv-attention", help="Attention over the K/V off a GPU: device copies it there, cpu computes it where it "
        "lives (only the query and the output cross the link), auto prices both.")] = "auto",
    micro_batches: Annotated[int | None, typer.Option(
        "--micro-batches", min=1, help="Pin the device micro-batches each pass over the weights serves.",
        show_default=False)] = None,
    prefetch_depth: Annotated[int | None, typer.Option(
        min=1, help="Pin the slots in the ring.", show_default=False)] = None,
    experts: Annotated[str, typer.Option(
        help="A mixture on a GPU: device copies each layer's routed experts to the GPU, cpu computes them on the CPU "
        "where they live, auto chooses per layer from the link's and the CPU's rates. Without a GPU the experts "
        "compute where they live, whatever this says.")] = "auto",
    cpu_expert_layers: CpuExpertLayers = None,
    cpu_memory: CpuMemory = None,
    gpu_memory: GpuMemory = None,
    host_ram: Annotated[str | None, typer.Option(
        "--host-ram", help="Describe another machine: its host memory, as 252GB.", show_default=False)] = None,
    gpu_ram: Annotated[str | None, typer.Option(
        "--gpu-ram", help="Describe another machine: its GPU's memory, as 48GB.", show_default=False)] = None,
    disk_gbps: DiskGbps = None,
    h2d_gbps: H2dGbps = None,
    gpu_tflops: GpuTflops = None,
    cpu_gbps: CpuGbps = None,
    cpu_tflops: CpuTflops = None,
    gpu_gbps: GpuGbps = None,
) -> None:
    """Choose the batch size, weight format, tiers, K/V offload and prefetch depth for the most tokens/s
    (or, with --latency, the least time per prompt), and predict prefill, decode step and what limits it.
    Works from the model's config alone; any choice given as a flag is pinned, as generate takes it."""
    from zerolite.planner.cost import Job
    from zerolite.planner.cpu_experts import with_cpu_experts
    from zerolite.planner.experts_side import EXPERTS_PINS
    from zerolite.planner.faults import planner_part
    from zerolite.planner.for_job import model_and_machine
    from zerolite.planner.hardware import parse_bandwidth, parse_flops
    from zerolite.planner.model_costs import WEIGHT_FORMATS
    from zerolite.planner.model_source import ModelSource
    from zerolite.planner.search import Pins, search
    from zerolite.runtime.policy import Policy, parse_size

    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ZeroliteError(f"unknown --weights {weights!r}: choose stored, int8 or int4")
    if experts not in EXPERTS_PINS:
        raise ZeroliteError(f"unknown --experts {experts!r}: choose device, cpu or auto")
    # generate's checks of those flags
    Policy(offload=offload or "nvme", device=device, kv_offload=kv_offload or 0.0, kv_disk=kv_disk or 0.0,
           kv_bits=kv_bits or 16, kv_attention=kv_attention, micro_batches=micro_batches or 1,
           experts=experts, cpu_expert_layers=cpu_expert_layers)
    flags = {
        "disk_gbps": parse_bandwidth(disk_gbps, "--disk-gbps") if disk_gbps else None,
        "h2d_gbps": parse_bandwidth(h2d_gbps, "--h2d-gbps") if h2d_gbps else None,
        "gpu_tflops": parse_flops(gpu_tflops, "--gpu-tflops") if gpu_tflops else None,
        "cpu_gbps": parse_bandwidth(cpu_gbps, "--cpu-gbps") if cpu_gbps else None,
        "cpu_tflops": parse_flops(cpu_tflops, "--cpu-tflops") if cpu_tflops else None,
        "gpu_gbps": parse_bandwidth(gpu_gbps, "--gpu-gbps") if gpu_gbps else None,
        "host_ram": parse_size(host_ram, "--host-ram") if host_ram else None,
        "gpu_ram": parse_size(gpu_ram, "--gpu-ram") if gpu_ram else None,
    }
    with planner_part("read the model's config"):
        source = ModelSource.resolve(model, dtype, path)
    layout_weights = source.weights
    if layout_weights is not None and weights not in (None, layout_weights):
        raise ZeroliteError(f"{model} is a layout of {layout_weights} weights: leave out --weights, or plan its "
                            "checkpoint to choose the format")
    described_gpu = flags["gpu_tflops"] is not None or flags["gpu_ram"] is not None
    if described_gpu and (flags["gpu_ram"] is None or flags["h2d_gbps"] is None or flags["gpu_tflops"] is None):
        raise ZeroliteError("a GPU other than this machine's needs --gpu-ram, --h2d-gbps and --gpu-tflops, as in "
                            "--gpu-ram 48GB --h2d-gbps 25GB/s --gpu-tflops 77TFLOPS")
    costs, hardware = model_and_machine(source, "cpu" if described_gpu else device, measure_disk=measure_disk_rate,
                                        probe=not described_gpu, disk_gbps=flags["disk_gbps"])
    hardware = hardware.with_flags(**flags, **({"gpu": True} if described_gpu else {}))
    with planner_part("time this machine's matmuls"):
        hardware = with_cpu_experts(hardware, costs, source.dtype)
    pins = Pins(weights=weights or layout_weights, batch_size=parse_batch_size(batch_size), kv_offload=kv_offload,
                cpu_memory=parse_size(cpu_memory, "--cpu-memory") if cpu_memory is not None else None,
                gpu_memory=parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else None,
                prefetch_depth=prefetch_depth, offload=offload, experts=None if experts == "auto" else experts,
                cpu_expert_layers=cpu_expert_layers, kv_bits=kv_bits, kv_disk=kv_disk,
                kv_attention=None if kv_attention == "auto" else kv_attention, micro_batches=micro_batches)
    job = Job(prompt_tokens, new_tokens, prompts)
    with planner_part("weigh the plans"):
        choice = search(costs, hardware, job, pins, latency=latency or pins.batch_size == 1)
    best = choice.best
    command = generate_command(model, best, hardware.gpu)
    if as_json:
        typer.echo(json.dumps(plan_dict(best, costs, hardware, command), indent=2))
        return
    show(costs, hardware, job, choice, command)


def measure_disk_rate(target) -> dict:
    from zerolite.planner.machine import measure_disk

    return measure_disk(target, scratch_bytes=1 << 30)


def generate_command(model: str | None, best, gpu: bool) -> list[str]:
    """The generate flags that run the chosen policy: every choice given, so that generate plans nothing anew."""
    c = best.candidate
    words = ["zerolite", "generate"] + (["--model", str(model)] if model else [])
    if c.weights != "stored":
        words += ["--weights", c.weights]
    words += ["--batch-size", str(c.batch_size), "--cpu-memory", megabytes(best.cpu_memory)]
    if gpu:
        words += ["--gpu-memory", megabytes(best.gpu_memory)]
    if c.kv_offload:
        words += ["--kv-offload", f"{c.kv_offload:g}"]
    if c.kv_disk:
        words += ["--kv-disk", f"{c.kv_disk:g}"]
    if c.kv_bits != 16:
        words += ["--kv-bits", str(c.kv_bits)]
    if gpu and c.kv_offload + c.kv_disk:
        words += ["--kv-attention", c.kv_attention]
    if c.micro_batches > 1:
        words += ["--micro-batches", str(c.micro_batches)]
    if best.experts is not None:
        words += ["--experts", "device" if best.experts == "device" else "cpu"]
        words += ["--cpu-expert-layers", str(c.cpu_expert_layers)] if best.experts == "split" else []
    return words + ["--prefetch-depth", str(c.prefetch_depth)]


def megabytes(nbytes: int) -> str:
    """A budget that holds nbytes, in whole MB (rounded up: a layer's budget must hold all of it)."""
    return "0" if nbytes == 0 else f"{math.ceil(nbytes / 1e6)}MB"


def plan_dict(best, costs, hardware, command: list[str]) -> dict:
    c = best.candidate
    return {
        "model": costs.name, "batch_size": c.batch_size, "weights": c.weights, "kv_offload": c.kv_offload,
        "kv_disk": c.kv_disk, "kv_bits": c.kv_bits, "kv_attention": c.kv_attention if hardware.gpu else "device",
        "micro_batches": c.micro_batches,
        "gpu_layers": c.gpu_layers, "host_layers": c.host_layers,
        "disk_layers": costs.layers - c.gpu_layers - c.host_layers,
        "prefetch_depth": c.prefetch_depth, "cpu_memory": best.cpu_memory, "gpu_memory": best.gpu_memory,
        "prefill_s": round(best.prefill_s, 4), "decode_step_s": round(best.decode_step_s, 4),
        "disk_s": round(best.disk_s, 4), "copy_s": round(best.copy_s, 4), "compute_s": round(best.compute_s, 4),
        "tokens_per_s": round(best.tokens_per_s, 3), "bottleneck": best.bottleneck, "fill_s": round(best.fill_s, 2),
        "job_s": round(best.job_s, 2), "host_bytes": best.host_bytes, "gpu_bytes": best.gpu_bytes,
        "experts": best.experts, "cpu_expert_layers": c.cpu_expert_layers, "cpu_s": round(best.cpu_s, 4),
        "hardware": {"gpu": hardware.gpu, "host_ram": hardware.host_ram, "gpu_ram": hardware.gpu_ram,
                     "disk_gbps": hardware.disk_gbps, "fill_gbps": hardware.fill_gbps, "h2d_gbps": hardware.h2d_gbps,
                     "gpu_tflops": hardware.gpu_tflops, "cpu_gbps": hardware.cpu_gbps,
                     "cpu_tflops": hardware.cpu_tflops, "gpu_gbps": hardware.gpu_gbps,
                     "sources": hardware.sources},
        "command": command,
    }


def experts_row(best, costs, hardware) -> str:
    """Where the chosen plan computes a mixture's routed experts, and at what rates."""
    where = best.experts
    if where is None:
        return ("routed experts computed where they live: on the CPU, with no GPU (auto, cpu and device are one here)"
                if not hardware.gpu else "every layer resident on the GPU, its experts with it")
    c = best.candidate
    streamed = costs.layers - c.gpu_layers
    cpu = f"the CPU at {hardware.cpu_gbps:.0f} GB/s and {hardware.cpu_tflops:g} TFLOPS"
    share = f"({best.cpu_s:.3f} s a step, round trips included)"
    link = f"copied to the GPU at {hardware.h2d_gbps:.1f} GB/s"
    if where == "device":
        return f"routed experts of all {streamed} streamed layers {link} (rather than computed by {cpu})"
    if where == "cpu":
        return (f"routed experts of all {streamed} streamed layers computed by {cpu} {share}; only their dense "
                "parts copied")
    return (f"routed experts of {c.cpu_expert_layers} of the {streamed} streamed layers computed by {cpu} {share}, "
            f"the other {streamed - c.cpu_expert_layers} layers' {link}")


def kv_row(best, costs, hardware, job) -> str:
    """Where the chosen plan keeps the K/V cache, at what bits, and who attends over it."""
    from zerolite.planner.kv_costs import shares

    c = best.candidate
    total = c.batch_size * (job.prompt_tokens + job.new_tokens) * costs.kv_bytes(c.kv_bits)
    device, host, disk = shares(hardware, c)
    places = [("on the GPU", device)] if hardware.gpu else []
    places += [("in host memory", host), ("on disk", disk)]
    where = ", ".join(f"{'all' if share == 1 else f'{share:.0%} of'} the layers' {name}"
                      for name, share in places if share)
    line = f"{total / 1e9:.1f} GB at {c.kv_bits} bits: {where or 'none'}"
    if hardware.gpu and host + disk:
        line += ("; attention over it on the CPU where it lives" if c.kv_attention == "cpu"
                 else "; copied to the GPU for attention")
    return line


def cpu_work(costs, c, hardware) -> str:
    """What a GPU machine's CPU computes in the chosen plan."""
    from zerolite.planner.kv_costs import cpu_attends

    work = (["experts"] if c.cpu_expert_layers else []) + (["attention"] if cpu_attends(hardware, c) else [])
    return " and ".join(work)


def show(costs, hardware, job, choice, command: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    best, c = choice.best, choice.best.candidate
    out = Console()
    fmt = costs.formats[c.weights]
    disk_layers = costs.layers - c.gpu_layers - c.host_layers
    stored = costs.formats["stored"]
    stored_bytes = stored.always_bytes + costs.layers * stored.layer_bytes
    out.print(f"[bold]{costs.name}[/bold]: {costs.layers} layers, {stored_bytes / 1e9:.1f} GB "
              f"in {str(costs.dtype).removeprefix('torch.')}; {job.prompt_tokens} prompt + {job.new_tokens} new tokens "
              f"per prompt, {job.prompts or c.batch_size} prompts", highlight=False)
    machine = ["GPU" if hardware.gpu else "CPU", f"host {hardware.host_ram / 1e9:.1f} GB"]
    if hardware.gpu:
        machine += [f"GPU {hardware.gpu_ram / 1e9:.1f} GB", f"copies {hardware.h2d_gbps:.1f} GB/s"]
    machine += [f"disk {hardware.disk_gbps:.2f} GB/s", f"fill {hardware.fill_gbps:.2f} GB/s"]
    sources = "; ".join(f"{k}: {v}" for k, v in hardware.sources.items())
    out.print("machine: " + ", ".join(machine) + "  [dim](" + sources + ")[/dim]", highlight=False)
    table = Table(title="plan", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    convert_once = f" (convert once: zerolite convert MODEL --weights {c.weights})" if c.weights != "stored" else ""
    table.add_row("weights", c.weights + convert_once)
    table.add_row("batch size", str(c.batch_size))
    tiers = []
    if hardware.gpu:
        tiers.append(f"{c.gpu_layers} on the GPU")
    tiers += [f"{c.host_layers} in host memory ({c.host_layers * fmt.layer_bytes / 1e9:.2f} GB)",
              f"{disk_layers} read from disk at every step ({disk_layers * fmt.layer_bytes / 1e9:.2f} GB)"]
    table.add_row("layers", ", ".join(tiers))
    table.add_row("K/V cache", kv_row(best, costs, hardware, job))
    if c.micro_batches > 1:
        table.add_row("micro-batches", f"{c.micro_batches} of {-(-c.batch_size // c.micro_batches)} sequences per pass "
                      "over the weights")
    table.add_row("prefetch depth", str(c.prefetch_depth))
    if costs.experts:
        table.add_row("experts", experts_row(best, costs, hardware))
    table.add_row("prefill", f"{best.prefill_s:.3f} s")
    parts = [f"disk {best.disk_s:.3f}", f"compute {best.compute_s:.3f}"]
    parts += [f"of it the CPU's {cpu_work(costs, c, hardware)} {best.cpu_s:.3f}"] if best.cpu_s else []
    parts += [f"copy {best.copy_s:.3f}"] if hardware.gpu else []
    table.add_row("decode step", f"{best.decode_step_s:.3f} s ({', '.join(parts)} s): {best.bottleneck}-bound")
    table.add_row("tokens/s", f"{best.tokens_per_s:.2f} (a batch's new tokens over its prefill and decode)")
    table.add_row("filling memory", f"{best.fill_s:.1f} s, once")
    table.add_row("the job", f"{best.job_s:.1f} s")
    memory = f"host {best.host_bytes / 1e9:.1f} of {hardware.host_ram / 1e9:.1f} GB"
    if hardware.gpu:
        memory += f", GPU {best.gpu_bytes / 1e9:.1f} of {hardware.gpu_ram / 1e9:.1f} GB"
    table.add_row("memory", memory)
    out.print(table)
    others = {}
    for p in choice.tried:
        w = p.candidate.weights
        if w != c.weights and (w not in others or p.tokens_per_s > others[w].tokens_per_s):
            others[w] = p
    for w, p in others.items():
        out.print(f"[dim]best with {w} weights: {p.tokens_per_s:.2f} tokens/s (batch {p.candidate.batch_size}, "
                  f"{p.bottleneck}-bound)[/dim]", highlight=False)
    out.print("run it: " + " ".join(command), highlight=False, soft_wrap=True)
