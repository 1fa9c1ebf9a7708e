"""A mixture's routed experts computed by the CPU of a GPU machine (`--experts cpu`): how fast the CPU
does it, and what one layer's experts cost it.

    hardware = with_cpu_experts(hardware, costs, torch.bfloat16)     # this CPU's rates where no flag gave them
    seconds = cpu_layer_seconds(costs, hardware, rows=1)

The rates are the compute probe's (zerolite.planner.compute_probe: nn.Linear and zerolite's own
int8/int4 CPU kernels, weights cycling through more memory than the caches hold), run on this
machine's CPU and recorded under its key, as a plan for a CPU alone records them: the bytes per
second its matmuls stream at one row, and its FLOP/s at the most rows probed. A layer's experts
then take the longer of their bytes over the first and their FLOPs over the second, and a round
trip: the host waits for the hidden states, the GPU for the experts' output (HostExperts).
A mixture's fused experts stay in the checkpoint's precision in every zerolite layout (int8 and
int4 quantize the linears: zerolite.quant.quantize.quantizable_linears), so it is the stored
format's rate that prices them. For another machine, --cpu-gbps and --cpu-tflops describe its CPU.
"""

from __future__ import annotations

import dataclasses

import torch

from zerolite.io.device import CpuDevice
from zerolite.planner import measurements
from zerolite.planner.compute_probe import probe_compute
from zerolite.planner.hardware import Hardware, probed
from zerolite.planner.model_costs import ModelCosts

EXPERTS_FORMAT = "stored"      # the format a layout keeps a mixture's experts in, whatever --weights says
ROUND_TRIP_S = 50e-6           # per layer: a wait for the device, a pinned copy each way, a wait for the copy back
                               # (an estimate from CUDA's synchronisation latencies, not measured here)


def with_cpu_experts(hardware: Hardware, costs: ModelCosts, dtype: torch.dtype) -> Hardware:
    """hardware with its CPU's rates for a mixture's experts, and for attention over the K/V in host
    memory (zerolite.planner.kv_costs): those it has (given as flags) as they are, the others this
    machine's CPU's (as recorded, else probed now). Left as it is for a machine without a GPU, where
    both compute where they live."""
    if not hardware.gpu or (hardware.cpu_gbps and hardware.cpu_tflops):
        return hardware
    gbps, tflops, source = this_cpu(dtype)
    return dataclasses.replace(hardware, cpu_gbps=hardware.cpu_gbps or gbps, cpu_tflops=hardware.cpu_tflops or tflops,
                               sources={**hardware.sources, "cpu": source})


def this_cpu(dtype: torch.dtype) -> tuple[float, float, str]:
    """(GB/s at one row, TFLOP/s at the most rows, where they came from) of this CPU's matmuls in
    the experts' format."""
    cpu = CpuDevice()
    rates, source = probed(measurements.compute_key(cpu, dtype), "compute", lambda: probe_compute(cpu, dtype),
                           "time this machine's matmuls", "compute: the CPU's matmul rates, for experts")
    source = f"this CPU's matmuls, {source}"
    per_weight = {int(rows): seconds for rows, seconds in rates[EXPERTS_FORMAT].items()}
    most = max(per_weight)
    return dtype.itemsize / per_weight[min(per_weight)] / 1e9, 2 * most / per_weight[most] / 1e12, source


def cpu_layer_seconds(costs: ModelCosts, hardware: Hardware, rows: float) -> float:
    """One layer's routed experts for rows tokens, computed by the CPU: the experts they pick read
    at its rate, or their FLOPs at its FLOP/s, whichever is longer, and the round trip of the
    hidden states (in and out, over the link)."""
    picked = costs.expected_experts(rows)
    streamed = picked * costs.formats[EXPERTS_FORMAT].expert_bytes / (hardware.cpu_gbps * 1e9)
    flops = 2 * rows * costs.experts_per_token * costs.expert_weights / (hardware.cpu_tflops * 1e12)
    hidden = 2 * rows * costs.shape.hidden * costs.dtype.itemsize / (hardware.h2d_gbps * 1e9)
    return max(streamed, flops) + hidden + ROUND_TRIP_S
