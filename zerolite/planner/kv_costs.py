"""What the K/V cache costs a step and holds in memory, wherever it lives and whoever attends over it:
its tiers (device, host memory, disk: --kv-offload and --kv-disk shares of the layers), its bits
(--kv-bits: quantized as appended, dequantised where attention reads it) and where attention over
the K/V off the device runs (--kv-attention: copied to the device, or computed by the CPU where it
lives, only the query and the output crossing the link).

    step = kv_step(costs, hardware, candidate, batch=64, context=600.0, prefill=False)
    step.disk_s, step.copy_s, step.compute_s, step.cpu_s

Per decode step of b sequences with context positions each (P: K/V at its bits, D: the same at 16):
  disk     the disk's share of P read (one layer ahead, beside the weights), and the new token's written
  copy     on a GPU, attention on the device: the off-device shares of P copied in; on the CPU: each
           such layer's query and output (2 x batch x hidden)
  compute  whoever attends reads its share of the cache twice and writes it once (a device layer's
           cache grows by concatenation, then attention reads it), at its memory rate: (2 P + D) / rate;
           at 8 or 4 bits it also dequantises D (the codec's seconds per element) and quantizes each
           layer's new keys and values (two calls a layer and micro-batch). On a GPU with attention on
           the CPU, the CPU's share runs in the compute chain in place of the GPU's, with a round trip
           per layer (the GPU waits for its output).
The prefill writes the prompt's K/V: to disk, over the link to host memory, through the codec.
Memory: each tier's share of the job's K/V at its bits; on the device, two layers' K/V copied in
(attention there over off-device K/V: the layer attended and the one being fetched) and one
micro-batch's layer dequantised; in host memory, two layers' K/V read from disk.

Memory rates: a GPU described by flags has --gpu-gbps; a processor measured here, the rate its
decode step's attention was timed to stream K/V at, and its codec as timed (zerolite.planner.kv_probe);
the CPU of a GPU machine, --cpu-gbps or its matmuls' (cpu_experts.this_cpu).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.planner.cpu_experts import ROUND_TRIP_S
from zerolite.planner.hardware import Hardware

CODEC_BYTES_PER_ELEMENT = {8: 8.0, 4: 12.0}  # memory traffic of dequantising one element with the codec's
                                             # elementwise passes, where it runs at the memory's rate (a GPU)
ENCODE_CALL_S = 100e-6      # quantizing one layer's new keys (or values) where unmeasured: a dozen small kernels
PROBE_ENCODE_ELEMENTS = 16 * 4 * 64  # what zerolite.planner.kv_probe times one encode call over


@dataclass(frozen=True)
class KvStep:
    disk_s: float = 0.0
    copy_s: float = 0.0
    compute_s: float = 0.0    # added to the compute chain
    cpu_s: float = 0.0        # of compute_s: the CPU's attention over the K/V it holds (a GPU machine)


@dataclass(frozen=True)
class Processor:
    """What attention over K/V costs where it runs: its memory rate and its codec."""
    memory_gbps: float | None      # None: no figure, attention's reads left to its FLOPs
    codec: dict[int, dict[str, float]]


def shares(hardware: Hardware, c) -> tuple[float, float, float]:
    """(device, host, disk) shares of the layers' K/V. Without a GPU the device's memory is the host's."""
    if hardware.gpu:
        return 1.0 - c.kv_offload - c.kv_disk, c.kv_offload, c.kv_disk
    return 0.0, 1.0 - c.kv_disk, c.kv_disk


def cpu_attends(hardware: Hardware, c) -> bool:
    """Whether the CPU of a GPU machine attends over the K/V that lives off the GPU."""
    return hardware.gpu and c.kv_attention == "cpu" and (c.kv_offload + c.kv_disk) > 0


def kv_step(costs, hardware: Hardware, c, batch: int, context: float, prefill: bool) -> KvStep:
    if not costs.shape.attending_layers:
        return KvStep()
    _, host, disk = shares(hardware, c)
    off = host + disk if hardware.gpu else 0.0
    itemsize = costs.dtype.itemsize
    packed, dense = batch * context * costs.kv_bytes(c.kv_bits), batch * context * costs.kv_bytes(16)
    layers = costs.shape.attending_layers
    rows, width = -(-batch // c.micro_batches), costs.shape.kv_heads * costs.shape.head_dim
    link = (hardware.h2d_gbps or 0.0) * 1e9
    if prefill:
        # The prompt's K/V written where it lives, and through the codec once (quantized) and back (the
        # update returns the layer's K/V decoded).
        codec = 2 * dense / itemsize * compute_device(hardware, costs).codec[c.kv_bits]["decode_s"] \
            if c.kv_bits < 16 else 0.0
        return KvStep(disk_s=disk * packed / (hardware.disk_gbps * 1e9), copy_s=off * packed / link if off else 0.0,
                      compute_s=codec)
    appended = batch * costs.kv_bytes(c.kv_bits)
    disk_s = disk * (packed + appended) / (hardware.disk_gbps * 1e9)
    on_cpu = cpu_attends(hardware, c)
    if on_cpu:
        copy_s = off * layers * 2 * batch * costs.shape.hidden * itemsize / link
        cpu = attention(described(hardware.cpu_gbps), c, off, packed, dense, itemsize, layers, rows, width) \
            + off * layers * c.micro_batches * ROUND_TRIP_S
        gpu = attention(compute_device(hardware, costs), c, 1.0 - off, packed, dense, itemsize, layers, rows, width)
        return KvStep(disk_s=disk_s, copy_s=copy_s, compute_s=gpu + cpu, cpu_s=cpu)
    copy_s = off * packed / link if off else 0.0
    gpu = attention(compute_device(hardware, costs), c, 1.0, packed, dense, itemsize, layers, rows, width)
    return KvStep(disk_s=disk_s, copy_s=copy_s, compute_s=gpu)


def attention(where: Processor, c, share: float, packed: float, dense: float, itemsize: int, layers: int,
              rows: int, width: int) -> float:
    """A processor's time for its share of the layers' K/V in a decode step: the cache's memory
    traffic, and at 8 or 4 bits the codec's dequantising and quantizing."""
    if share <= 0:
        return 0.0
    seconds = share * (2 * packed + dense) / (where.memory_gbps * 1e9) if where.memory_gbps else 0.0
    if c.kv_bits < 16:
        rates = where.codec[c.kv_bits]
        per_call = rates["encode_s"] * max(1.0, rows * width / PROBE_ENCODE_ELEMENTS)  # width: a token's keys
        seconds += share * (dense / itemsize * rates["decode_s"] + 2 * layers * c.micro_batches * per_call)
    return seconds


def compute_device(hardware: Hardware, costs) -> Processor:
    """The processor the layers compute on: a described GPU by its flags, else as measured here."""
    if hardware.compute is None:  # a GPU described by flags
        return described(hardware.gpu_gbps)
    return Processor(hardware.attention_gbps, hardware.kv_codec or described(None).codec)


def described(gbps: float | None) -> Processor:
    """A processor known by its memory rate alone (a described GPU, a GPU machine's CPU): its codec at
    that rate."""
    codec = {bits: {"decode_s": per / (gbps * 1e9) if gbps else 0.0, "encode_s": ENCODE_CALL_S}
             for bits, per in CODEC_BYTES_PER_ELEMENT.items()}
    return Processor(gbps, codec)


def kv_memory(costs, hardware: Hardware, c, tokens: int) -> tuple[float, float]:
    """(host bytes, device bytes) the K/V of c's batch of tokens-long sequences holds, with the
    buffers reading it takes: on a CPU machine both are host memory (device bytes 0)."""
    if not costs.shape.attending_layers:
        return 0.0, 0.0
    device, host, disk = shares(hardware, c)
    kv = c.batch_size * tokens * costs.kv_bytes(c.kv_bits)
    layer = kv / costs.shape.attending_layers
    rows = -(-c.batch_size // c.micro_batches)
    decoded = rows * tokens * costs.kv_bytes(16) / costs.shape.attending_layers if c.kv_bits < 16 else 0.0
    staging = 2 * layer if disk else 0.0   # read one layer ahead from disk, into host memory
    if not hardware.gpu:
        return host * kv + staging + decoded, 0.0
    on_cpu = cpu_attends(hardware, c)
    copied_in = 2 * layer if (host + disk) and not on_cpu else 0.0
    host_bytes = host * kv + staging + (decoded if on_cpu else 0.0)
    return host_bytes, device * kv + copied_in + decoded
