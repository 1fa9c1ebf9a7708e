"""How fast this machine's processor attends over K/V, and keeps it at 8 and 4 bits (--kv-bits): the
rate a decode step's attention streams the K/V at, what quantizing a step's new token costs a layer,
and what dequantising the layer's K/V costs per element, with the codec a run uses
(zerolite.quant.kv_codec), for the cost model.

    gbps = probe_attention(CpuDevice(), torch.bfloat16)
    rates = probe_kv_codec(CpuDevice(), torch.bfloat16)
    rates[4]["decode_s"]      # seconds per K/V element dequantised where attention reads it
    rates[4]["encode_s"]      # seconds to quantize one step's new keys (or values) of one layer

Attention's rate is timed on what a decode step does with a layer's K/V at 16 bits (the new token
appended by torch.cat, as transformers' cache does, then scaled_dot_product_attention over it),
over several layers' K/V together larger than the caches: a matmul's rate at one row stands for
it no better than any other op, and taken under load once priced that attention at 10x its time.

Both are real costs on a CPU: decoding (zerolite.quant.kv_decode's kernel, one pass) writes twice
the bytes it reads, and quantizing a token is a dozen small ops whose fixed cost is most of it,
twice per layer and step.
A GPU described by flags has no probe: its codec runs at its memory bandwidth
(zerolite.planner.kv_costs.described_codec).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from zerolite.io.device import Device
from zerolite.quant.kv_codec import KVCodec

SHAPE = (16, 4, 1024, 64)   # batch, heads, tokens, width: 4M elements, past the caches
MIN_SECONDS = 0.05
ATTENDED_LAYERS = 8         # layers' K/V cycled through by the attention probe: 128 MB at 16 bits


def probe_attention(device: Device, dtype: torch.dtype) -> float:
    """GB/s a decode step's attention streams a layer's K/V at, its traffic counted as
    zerolite.planner.kv_costs counts it: at 16 bits, appending reads and writes it (2 x) and
    attention reads it (1 x)."""
    target = device.torch_device
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(SHAPE, generator=generator).to(dtype).to(target)
    layers = [(states.clone(), states.clone()) for _ in range(ATTENDED_LAYERS)]
    query, token = (torch.randn(SHAPE[0], SHAPE[1], 1, SHAPE[3], generator=generator).to(dtype).to(target)
                    for _ in range(2))

    @torch.inference_mode()
    def step() -> None:
        for keys, values in layers:
            F.scaled_dot_product_attention(query, torch.cat([keys, token], dim=-2), torch.cat([values, token], dim=-2))

    seconds = timed(step, device) / ATTENDED_LAYERS
    return 3 * 2 * states.nbytes / seconds / 1e9


def probe_kv_codec(device: Device, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(SHAPE, generator=generator).to(dtype).to(device.torch_device)
    token = states[:, :, -1:].contiguous()
    rates = {}
    for bits in (8, 4):
        codec = KVCodec(bits)
        packed = codec.encode(states)
        decode = timed(lambda c=codec, p=packed: c.decode(p, dtype, SHAPE[-1]), device) / states.numel()
        rates[bits] = {"decode_s": decode, "encode_s": timed(lambda c=codec: c.encode(token), device)}
    return rates


def timed(call, device: Device) -> float:
    """Seconds per call, the calls repeated for MIN_SECONDS (after one untimed)."""
    call()
    device.synchronize()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < MIN_SECONDS:
        call()
        calls += 1
    device.synchronize()
    return (time.perf_counter() - started) / calls
