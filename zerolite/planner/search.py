"""The search: every policy worth trying for a model on a machine, predicted, and the best kept.

    choice = search(costs, hardware, job, Pins(weights="int4"))
    choice.best.tokens_per_s

It tries the weight formats, batch sizes (powers of two, and the pinned one), the K/V's bits,
prefetch depths, how many layers to keep on the GPU and in host memory (as many as fit, none, and
steps between: holding layers costs fill time that a short job may not win back), for each the
K/V's placement, where attention over it runs and the micro-batches a pass serves (kv_side), and
on a GPU how many of a mixture's layers have their experts computed on the CPU (experts_side).
Whatever is pinned (the flags generate takes) is held to. Throughput ranks candidates by the job's
tokens per second, fill included; latency (batch 1) by the job's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerolite.errors import ZeroliteError
from zerolite.io.engine import host_bytes
from zerolite.memory_model import KV_BITS
from zerolite.planner.cost import Candidate, Job, Prediction, Rates, on_gpu, predict
from zerolite.planner.experts_side import experts_sides
from zerolite.planner.hardware import Hardware
from zerolite.planner.kv_side import Room, kv_sides, placements
from zerolite.planner.model_costs import WEIGHT_FORMATS, ModelCosts

BATCH_SIZES = tuple(2**k for k in range(11))   # 1 .. 1024
PREFETCH_DEPTHS = (2, 3, 4, 6, 8, 12, 16)  # deep rings keep the disk reading while held layers compute
KV_BITS_GAIN = 0.01   # the share of tokens/s (or of the job's time) K/V at fewer bits must gain to be chosen
TIER_STEPS = 8                                  # host-tier sizes tried between none and all that fit


@dataclass(frozen=True)
class Pins:
    """The choices the user fixed, as generate's flags: None leaves it to the search."""
    weights: str | None = None
    batch_size: int | None = None
    kv_offload: float | None = None
    cpu_memory: int | None = None     # bytes of layers in host memory
    gpu_memory: int | None = None     # bytes resident on the GPU
    prefetch_depth: int | None = None
    offload: str | None = None        # "nvme", "cpu" or "none"
    experts: str | None = None        # a mixture's on a GPU: "device" (or "routed"), "cpu"; None or "auto": searched
    cpu_expert_layers: int | None = None  # with experts "cpu": how many layers (None: every streamed one)
    kv_bits: int | None = None
    kv_disk: float | None = None      # share of the layers' K/V on disk
    kv_attention: str | None = None   # over K/V off a GPU: "device", "cpu"; None or "auto": searched
    micro_batches: int | None = None


@dataclass
class Choice:
    best: Prediction
    tried: list[Prediction] = field(default_factory=list)   # every candidate that fits


def search(costs: ModelCosts, hardware: Hardware, job: Job, pins: Pins = Pins(), latency: bool = False) -> Choice:
    formats = [pins.weights] if pins.weights else [w for w in WEIGHT_FORMATS if w in costs.formats]
    if pins.weights and pins.weights not in costs.formats:
        raise ZeroliteError(f"--weights {pins.weights} cannot store this model's layers (int4 needs output widths "
                            "in multiples of its row block): choose stored or int8")
    batches = [pins.batch_size] if pins.batch_size else ([1] if latency else BATCH_SIZES)
    if job.prompts and not pins.batch_size:  # no batch beyond the job's prompts
        batches = sorted({min(b, job.prompts) for b in batches})
    bits = [pins.kv_bits] if pins.kv_bits else KV_BITS
    depths = [pins.prefetch_depth] if pins.prefetch_depth else PREFETCH_DEPTHS
    room, every = Room(costs, hardware, job, placements(hardware, pins.kv_offload, pins.kv_disk)), []
    rates = Rates(costs, hardware)
    nearest, nearest_lacking = None, None  # of the policies that do not fit, the one that lacks least
    for weights in formats:
        for batch in batches:
            for kv_bits in bits:
                for depth in depths:
                    for gpu_layers, host_layers in tiers(costs, hardware, weights, pins):
                        base = Candidate(weights, batch, host_layers, gpu_layers, prefetch_depth=depth, kv_bits=kv_bits)
                        fitting, least, lacking = kv_sides(costs, hardware, base, pins, room)
                        if not fitting and (nearest_lacking is None or lacking < nearest_lacking):
                            nearest, nearest_lacking = least, lacking
                        for candidate in fitting:
                            every += experts_sides(costs, hardware, candidate, job, pins.experts,
                                                   pins.cpu_expert_layers, rates)
    tried = [p for p in every if p.fits(hardware)]
    if not tried:
        raise ZeroliteError(cannot_fit(costs, hardware, job, formats) if pins == Pins()
                            else pinned_too_big(every + experts_sides(costs, hardware, nearest, job, pins.experts,
                                                                      pins.cpu_expert_layers), hardware))

    def rank(p: Prediction):
        c = p.candidate
        tokens = (job.prompts or c.batch_size) * job.new_tokens
        speed = -p.job_s if latency else tokens / p.job_s
        # Among equals, the K/V at the most bits (the fewer lost), the fewest micro-batches, the fewest
        # bytes held and the shallowest ring; and where the disk bounds a step whatever the experts
        # do, the split that leaves the link and the compute most room.
        return (round(speed, 6), c.kv_bits, -c.micro_batches, -p.host_bytes - p.gpu_bytes, -c.prefetch_depth,
                -max(p.copy_s, p.compute_s))

    best = max(tried, key=rank)
    # K/V at fewer bits loses some accuracy: it is chosen only where it gains more than KV_BITS_GAIN
    for bits in sorted({p.candidate.kv_bits for p in tried}, reverse=True):
        if bits <= best.candidate.kv_bits:
            break
        more = max((p for p in tried if p.candidate.kv_bits == bits), key=rank)
        kept, chosen = rank(more)[0], rank(best)[0]  # tokens/s, or minus the job's seconds (latency)
        if (kept >= chosen * (1 + KV_BITS_GAIN)) if latency else (kept * (1 + KV_BITS_GAIN) >= chosen):
            best = more
            break
    return Choice(best, tried)


def tiers(costs: ModelCosts, hardware: Hardware, weights: str, pins: Pins) -> list[tuple[int, int]]:
    """(GPU layers, host layers) to try: the pinned budgets as generate's plan takes them, else from
    none to every layer, in steps (the memory check drops what does not fit)."""
    fmt, layers = costs.formats[weights], costs.layers
    if pins.offload == "none":
        return [(layers, 0)] if hardware.gpu else [(0, layers)]
    if hardware.gpu:
        on_device = on_gpu(costs, weights)
        if pins.gpu_memory is not None:
            gpu_options = [min(max(pins.gpu_memory - fmt.always_bytes, 0) // on_device, layers)]
        else:
            gpu_options = steps(layers)
    else:
        gpu_options = [0]
    options = []
    for gpu_layers in gpu_options:
        rest = layers - gpu_layers
        if pins.offload == "cpu":
            hosts = [rest]
        elif pins.cpu_memory is not None:
            hosts = [min(pins.cpu_memory // host_bytes(fmt.layer_bytes), rest)]
        else:
            hosts = sorted({min(h, rest) for h in steps(layers)})
        options += [(gpu_layers, host) for host in hosts]
    return options


def steps(layers: int) -> list[int]:
    return sorted({round(layers * k / TIER_STEPS) for k in range(TIER_STEPS + 1)})


def pinned_too_big(every: list[Prediction], hardware: Hardware) -> str:
    """What the smallest policy the pins allow needs, against what the machine has."""
    least = min(every, key=lambda p: max(p.host_bytes - hardware.host_ram, 0) + max(p.gpu_bytes - hardware.gpu_ram, 0))
    c = least.candidate
    needs = [f"{least.host_bytes / 1e9:.1f} GB of host memory ({hardware.host_ram / 1e9:.1f} GB is free)"]
    if hardware.gpu:
        needs.append(f"{least.gpu_bytes / 1e9:.1f} GB on the GPU ({hardware.gpu_ram / 1e9:.1f} GB)")
    return (f"no policy the given flags allow fits: the smallest ({c.weights} weights, batch {c.batch_size}, "
            f"{c.host_layers} layers in host memory) needs {' and '.join(needs)}: lower --batch-size, --cpu-memory or "
            "--gpu-memory, or leave them to the search")


def cannot_fit(costs: ModelCosts, hardware: Hardware, job: Job, formats: list[str]) -> str:
    """What would have to change for the smallest policy (batch 1, every layer streamed, its K/V
    offloaded) to fit."""
    smallest = min(formats, key=lambda w: costs.formats[w].layer_bytes)
    least = predict(costs, hardware, Candidate(smallest, 1, 0, 0, 0.0, 1, kv_bits=min(KV_BITS),
                                               kv_disk=1.0), job)
    where = []
    if hardware.gpu and least.gpu_bytes > hardware.gpu_ram:
        where.append(f"a GPU with {least.gpu_bytes / 1e9:.1f} GB free (it has {hardware.gpu_ram / 1e9:.1f} GB)")
    if least.host_bytes > hardware.host_ram:
        where.append(f"{least.host_bytes / 1e9:.1f} GB of host memory ({hardware.host_ram / 1e9:.1f} GB is free)")
    quantize = "" if smallest == "int4" or "int4" not in costs.formats else ", or --weights int4"
    return (f"{costs.name} cannot run here even at batch 1 with every layer streamed ({smallest} weights, "
            f"{costs.formats[smallest].layer_bytes / 1e9:.2f} GB a layer): "
            f"it needs {' and '.join(where) or 'more memory'}; shorten --prompt-tokens/--new-tokens{quantize}")
