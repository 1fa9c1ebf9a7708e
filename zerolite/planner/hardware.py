"""The machine a plan is for: its memory, its links' speeds and its compute, each with where it came
from (measured here and recorded, given as a flag, or taken from this machine now).

    hardware = Hardware.here(device="cpu", disk_target=..., dtype=torch.bfloat16)
    hardware = Hardware.described(gpu_ram=..., host_ram=..., disk_gbps=5.6, h2d_gbps=25, gpu_tflops=77)

On a GPU machine, a mixture's routed experts may compute on the CPU instead: its rates for them
(cpu_gbps, cpu_tflops) come from zerolite.planner.cpu_experts.

A machine described by flags has a GPU when it is given GPU memory or TFLOPS; its compute is then
the FLOPs at that rate (a GPU's matmuls at a batch's rows are far from memory-bound at the sizes
offloading runs at). This machine's compute is the probe's (zerolite.planner.compute_probe).
"""

from __future__ import annotations

import math
import re
from contextlib import nullcontext
from dataclasses import dataclass, field

import psutil
import torch

from zerolite.errors import ZeroliteError
from zerolite.io.device import resolve
from zerolite.planner import measurements
from zerolite.planner.compute_probe import PROBE_LAYER_MAX_BYTES, probe_compute, probe_layer
from zerolite.planner.contention import Contention
from zerolite.planner.faults import planner_part
from zerolite.planner.kv_probe import probe_attention, probe_kv_codec
from zerolite.planner.machine import measure_host_to_device
from zerolite.progress import measuring, stderr

BANDWIDTH_UNITS = {"gb/s": 1.0, "mb/s": 1e-3, "tb/s": 1e3, "gib/s": 2**30 / 1e9, "mib/s": 2**20 / 1e9}
FLOPS_UNITS = {"tflops": 1.0, "tflop/s": 1.0, "gflops": 1e-3, "gflop/s": 1e-3, "pflops": 1e3, "pflop/s": 1e3}
RUNTIME_BYTES = 1_500_000_000   # the process itself: torch, transformers, the engine's queues
CUDA_CONTEXT_BYTES = 500_000_000  # a described GPU's memory that CUDA's context and torch's kernels take first (what a
                                  # GPU measured here reports free is past it already)


@dataclass(frozen=True)
class Hardware:
    gpu: bool
    gpu_ram: int                      # bytes a run may use on the GPU (0 without one)
    host_ram: int                     # bytes a run may use in host memory
    disk_gbps: float                  # the layout's file system, O_DIRECT through the engine
    fill_gbps: float                  # loading layers into host memory, first touch of its pages included
    h2d_gbps: float | None            # pinned host memory to the GPU
    gpu_tflops: float | None          # dense matmul rate of a described GPU
    compute: dict[str, dict[int, float]] | None = None  # probed: seconds per weight by format and rows
    layer_seconds: dict[int, float] | None = None   # probed for the model planned: one decoder layer's decode
    step_seconds: dict[int, float] | None = None    # step by batch, and the step's cost besides layers and head
    sources: dict[str, str] = field(default_factory=dict)
    cpu_gbps: float | None = None     # a GPU machine's CPU: weight bytes/s its expert matmuls stream at batch 1
    cpu_tflops: float | None = None   # ... and their FLOP/s at a large batch (zerolite.planner.cpu_experts)
    gpu_gbps: float | None = None     # a described GPU's memory bandwidth: the floor of a small batch's matmuls, and
                                      # the rate its dequantisation and attention's reads of the K/V run at
    gpu_context: int = 0              # bytes of gpu_ram a run cannot have (a described GPU's CUDA context)
    kv_codec: dict[int, dict[str, float]] | None = None  # probed: K/V at 8 and 4 bits (zerolite.planner.kv_probe)
    attention_gbps: float | None = None  # probed: the rate a decode step's attention streams K/V at (the same)

    def seconds(self, weights: str, elements: float, rows: float, itemsize: int = 2) -> float:
        """Time to multiply rows rows by elements weights stored in the format weights; a described GPU's
        at its FLOPs, or where fewer rows leave it waiting on its memory, the weights (itemsize bytes
        each, dequantised: zerolite.planner.cost prices that) read at its bandwidth."""
        if elements <= 0 or rows <= 0:
            return 0.0
        if self.compute is None:
            floor = elements * itemsize / (self.gpu_gbps * 1e9) if self.gpu_gbps else 0.0
            return max(2 * elements * rows / (self.gpu_tflops * 1e12), floor)
        return elements * at(self.compute[weights], rows)

    def flop_seconds(self, flops: float) -> float:
        """Time for flops of attention: at the dense large-batch rate."""
        if self.compute is None:
            return flops / (self.gpu_tflops * 1e12)
        rows, per_weight = max(self.compute["stored"].items())
        return flops * per_weight / (2 * rows)

    @classmethod
    def here(cls, device: str, disk_target, dtype: torch.dtype, measure_disk=None, probe: bool = True,
             disk_gbps: float | None = None, model=None) -> Hardware:
        """This machine: memory free now, the disk's rate as last recorded for that file system
        (else measured now, through measure_disk(folder) -> zerolite.planner.machine.measure_disk's
        figures, unless given), copies and compute
        as recorded (else measured now; compute only with probe)."""
        sources = {}
        target = resolve(device)
        gpu = target.separate_memory
        host_ram = psutil.virtual_memory().available
        sources["host_ram"] = "free now"
        gpu_ram = target.memory()[0] if gpu else 0
        if gpu:
            sources["gpu_ram"] = "free now"
        fs = measurements.file_system(disk_target)
        disk = disk_gbps or measurements.value(fs, "disk_gbps")
        if disk_gbps is not None:
            sources["disk_gbps"] = "given"
        elif disk is None and measure_disk is not None:
            with planner_part(f"measure the disk at {disk_target}"), measuring(f"disk: reading {disk_target}"):
                figures = measure_disk(disk_target)
            disk = figures["read_gbps"]
            measurements.record_disk(disk_target, disk, figures["bytes"])
            sources["disk_gbps"] = f"measured now ({figures['bytes'] / 1e9:.2f} GB read)"
        elif disk is not None:
            sources["disk_gbps"] = f"recorded ({measurements.path()})"
        if disk is None:
            raise ZeroliteError("no disk rate is recorded for this file system: "
                                "run zerolite profile once, or give --disk-gbps")
        fill = measurements.fill_gbps()
        sources["fill_gbps"] = ("recorded: every load's bytes over its seconds" if fill is not None
                                else "assumed: the disk's rate")
        h2d = measurements.value("h2d_gbps") if gpu else None
        if gpu and h2d is None:
            with (planner_part("time copies from host memory to the GPU"),
                  measuring("copies from host memory to the GPU")):
                h2d = measure_host_to_device(target)
            measurements.record("h2d_gbps", h2d)
        key = measurements.compute_key(target, dtype)
        if not probe:
            return cls(gpu, gpu_ram, host_ram, disk, fill or disk, h2d, None, sources=sources)
        compute, sources["compute"] = probed(key, "compute", lambda: probe_compute(target, dtype),
                                             "time this machine's matmuls",
                                             "compute: matmul rates of each weight format")
        compute = {weights: {int(rows): s for rows, s in rates.items()} for weights, rates in compute.items()}
        codec = kv_codec(target, dtype, key)
        attention, sources["attention"] = probed(key, ATTENTION_RECORD, lambda: probe_attention(target, dtype),
                                                 "time this machine's attention", "compute: attention over K/V")
        layer = step = None
        if model is not None:  # (config, a layer's bytes): the model's own layer timed, if not too large
            layers, source = model_layer(*model, f"{key} | {config_digest(model[0])}", dtype, target)
            if layers is not None:
                layer, step = ({int(rows): s for rows, s in layers[part].items()} for part in ("layer", "step"))
                sources["layer"] = f"probed: the model's own layer, {source}"
        return cls(gpu, gpu_ram, host_ram, disk, fill or disk, h2d, None, compute, layer, step, sources,
                   kv_codec=codec, attention_gbps=attention)

    def with_flags(self, **given) -> Hardware:
        """This machine, any figure given as a flag taking the measured one's place."""
        from dataclasses import replace

        given = {k: v for k, v in given.items() if v is not None}
        sources = {**self.sources, **{k: "given" for k in given}}
        if "disk_gbps" in given and "fill_gbps" not in given:  # another disk: this one's fill rate says nothing of it
            given["fill_gbps"] = given["disk_gbps"]
            sources["fill_gbps"] = "assumed: the disk's rate"
        if "gpu_tflops" in given:  # another GPU: its FLOPs, not this machine's probes
            given.update(compute=None, layer_seconds=None, step_seconds=None, kv_codec=None, attention_gbps=None)
        if "gpu_ram" in given:  # the card's memory, some of which CUDA takes before a run has any
            given["gpu_context"] = CUDA_CONTEXT_BYTES
            sources["gpu_ram"] = f"given, less {CUDA_CONTEXT_BYTES / 1e9:.1f} GB for CUDA's context"
        return replace(self, **given, sources=sources)


# where the codec's timings are recorded: not "kv_codec", which holds the torch passes' from before
# the CPU decode kernel (zerolite.quant.kv_decode), several times slower
KV_CODEC_RECORD = "kv_codec with the decode kernel"
ATTENTION_RECORD = "kv attention gbps"   # zerolite.planner.kv_probe.probe_attention's rate


def probed(key: str, under: str, probe, part: str | None, what: str) -> tuple:
    """(a probe's figures, where they came from): as recorded under key in under, else timed now by
    probe() (the planner's part called part where it fails, what saying what is measured) and
    recorded, marked busy where other work took the cores meanwhile (zerolite.planner.contention):
    such a probe serves the plans after it until one finds the machine quiet (measurements.kept)."""
    figures = measurements.kept(key, under)
    if figures is not None:
        return figures, "recorded"
    with planner_part(part) if part else nullcontext(), measuring(what), Contention() as load:
        figures = probe()
    if load.quiet:
        measurements.record(key, figures, under)
        return figures, "measured now"
    measurements.record(key, figures, under, busy_cores=load.others_cores)
    return figures, f"measured now, while other work took {load.others_cores:.1f} cores: to be measured again"


def kv_codec(target, dtype: torch.dtype, key: str) -> dict[int, dict[str, float]]:
    """The K/V codec's timings on target (zerolite.planner.kv_probe), as recorded under key or timed now."""
    codec, _ = probed(key, KV_CODEC_RECORD, lambda: probe_kv_codec(target, dtype), "time this machine's K/V codec",
                      "compute: K/V at 8 and 4 bits")
    return {int(bits): rates for bits, rates in codec.items()}


def model_layer(config, layer_bytes: int, key: str, dtype: torch.dtype, target) -> tuple[dict | None, str]:
    """The probe of one of the model's own layers (compute_probe.probe_layer) and where it came from,
    as recorded under key or timed now; None for a layer larger than PROBE_LAYER_MAX_BYTES, or one
    the probe cannot time: the matmul rates stand for it. A plan is advice, so a probe that fails
    costs no run (fourteen families' runs once stopped there): whatever it raises is said in one
    line, and the plan goes on."""
    if layer_bytes > PROBE_LAYER_MAX_BYTES:
        return measurements.value(key, "layers"), "recorded"
    try:
        return probed(key, "layers", lambda: probe_layer(config, dtype, target), None,
                      "compute: one of this model's layers")
    except Exception as e:  # noqa: BLE001 - any family's failure, whatever its type
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        stderr.print(f"plan: could not time one of this model's layers ({reason}); compute estimated from matmul rates",
                     markup=False, highlight=False, soft_wrap=True)
        return None, ""


def at(points: dict[int, float], rows: float) -> float:
    """A probed figure at rows: log-linear between the probed row counts, in proportion past the last."""
    ordered = sorted(points.items())
    if rows >= ordered[-1][0]:
        last_rows, last = ordered[-1]
        return last * rows / last_rows
    if rows <= ordered[0][0]:
        return ordered[0][1]
    below = max(p for p in ordered if p[0] <= rows)
    above = min(p for p in ordered if p[0] >= rows)
    if above[0] == below[0] or below[1] <= 0 or above[1] <= 0:
        return below[1]
    t = (math.log(rows) - math.log(below[0])) / (math.log(above[0]) - math.log(below[0]))
    return math.exp(math.log(below[1]) * (1 - t) + math.log(above[1]) * t)


def parse_bandwidth(text: str, flag: str) -> float:
    """"5.6GB/s", "800MB/s" or "2GiB/s" in GB/s (decimal); a bare number is refused: units differ by 1000x."""
    return parse_rate(text, flag, BANDWIDTH_UNITS, "5.6GB/s or 800MB/s")


def parse_flops(text: str, flag: str) -> float:
    """"77TFLOPS" or "500GFLOPS" in TFLOP/s."""
    return parse_rate(text, flag, FLOPS_UNITS, "77TFLOPS or 500GFLOPS")


def parse_rate(text: str, flag: str, units: dict[str, float], example: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z/]*)\s*", text)
    if not match or match[2].lower() not in units:
        what = "has no unit" if match and not match[2] else "is not a rate"
        raise ZeroliteError(f"{flag} {text!r} {what}: write it with one, as in {example}")
    rate = float(match[1]) * units[match[2].lower()]
    if rate <= 0:
        raise ZeroliteError(f"{flag} must be above zero, got {text!r}")
    return rate


def config_digest(config) -> str:
    """A model's shape, for keeping what was probed of it."""
    import hashlib

    return hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
