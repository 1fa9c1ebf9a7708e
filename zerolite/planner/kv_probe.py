"""How fast this machine's processor keeps K/V at 8 and 4 bits (--kv-bits): what quantizing a step's new
token costs a layer, and what dequantising the layer's K/V costs per element, with the codec a run uses
(zerolite.quant.kv_codec), for the cost model.

    rates = probe_kv_codec(CpuDevice(), torch.bfloat16)
    rates[4]["decode_s"]      # seconds per K/V element dequantised where attention reads it
    rates[4]["encode_s"]      # seconds to quantize one step's new keys (or values) of one layer

Both are real costs on a CPU: decoding (zerolite.quant.kv_decode's kernel, one pass) writes twice
the bytes it reads, and quantizing a token is a dozen small ops whose fixed cost is most of it,
twice per layer and step.
A GPU described by flags has no probe: its codec runs at its memory bandwidth
(zerolite.planner.kv_costs.described_codec).
"""

from __future__ import annotations

import time

import torch

from zerolite.io.device import Device
from zerolite.quant.kv_codec import KVCodec

SHAPE = (16, 4, 1024, 64)   # batch, heads, tokens, width: 4M elements, past the caches
MIN_SECONDS = 0.05


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
