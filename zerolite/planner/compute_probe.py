"""How fast this machine multiplies weights: seconds per weight element, by weight format and by
the rows multiplied at once, with the very modules a run uses (nn.Linear, and zerolite's Int8Linear
and Int4Linear with their CPU kernels), so a CPU's kernel quirks (int4's bf16-only fast path, a
bf16 matmul without AVX-512 BF16) are measured, not assumed.

    rates = probe_compute(CpuDevice(), torch.bfloat16)   # {"stored": {1: 2.1e-10, 4: ..., ...}, "int8": ..., "int4": ...}

The weights cycle through several matrices larger than a CPU's caches together, as a pass over a
model's layers does, so a small batch pays for reading its weights from memory.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zerolite.io.device import Device
from zerolite.quant.linear import Int4Linear, Int8Linear
from zerolite.quant.quantize import SCALE_SUFFIX, SCALE_ZERO_SUFFIX, WeightScheme

ROWS = (1, 4, 16, 64, 256, 1024)
SHAPE = (4096, 4096)        # out, in: a mid-sized model's projection
MATRICES = 6                # 6 x 32 MB in bf16: beyond the caches, as a layer's weights are
MIN_SECONDS = 0.15          # each point timed over this long at least


def probe_compute(device: Device, dtype: torch.dtype, formats=("stored", "int8", "int4")) -> dict[str, dict[int, float]]:
    generator = torch.Generator().manual_seed(0)
    dense = [torch.randn(SHAPE, generator=generator).to(dtype) for _ in range(MATRICES)]
    rates = {}
    for weights in formats:
        modules = [module_for(weights, w, device) for w in dense]
        rates[weights] = {rows: seconds_per_weight(modules, rows, dtype, device) for rows in ROWS}
    return rates


def module_for(weights: str, weight: torch.Tensor, device: Device) -> nn.Module:
    out_features, in_features = weight.shape
    target = device.torch_device
    if weights == "stored":
        linear = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=weight.dtype)
        linear.weight = nn.Parameter(weight.to(target), requires_grad=False)
        return linear
    scheme = WeightScheme.parse(weights)
    stored = scheme.quantize(weight)
    dequantize = device.separate_memory  # a GPU dequantises, as a run there does
    module = (Int8Linear(out_features, in_features, weight.dtype, None, dequantize) if weights == "int8"
              else Int4Linear(out_features, in_features, scheme, weight.dtype, None, dequantize))
    module.weight = stored[""].to(target)
    companion = SCALE_SUFFIX if weights == "int8" else SCALE_ZERO_SUFFIX
    setattr(module, "weight" + companion, stored[companion].to(target))
    return module


@torch.inference_mode()
def seconds_per_weight(modules: list[nn.Module], rows: int, dtype: torch.dtype, device: Device) -> float:
    x = torch.randn(rows, SHAPE[1], dtype=dtype, device=device.torch_device)
    for module in modules[:2]:
        module(x)  # kernels chosen, pages touched
    calls, started = 0, time.perf_counter()
    while True:
        for module in modules:
            module(x)
        calls += len(modules)
        device.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= MIN_SECONDS and calls >= 2 * len(modules):
            return elapsed / calls / (SHAPE[0] * SHAPE[1])


LAYER_ROWS = (1, 4, 16, 64, 256)
LAYER_CONTEXT = 32           # positions already cached when a decode step is timed
PROBE_LAYER_MAX_BYTES = 1 << 30  # larger layers are left to the matmul rates (their matmuls dwarf the rest)


def probe_layer(config, dtype: torch.dtype, device: Device) -> dict[str, dict[int, float]]:
    """{"layer": seconds, "step": seconds} by batch size: what one of the model's own decoder layers
    takes for a decode step (one new position per sequence, LAYER_CONTEXT cached), and what the
    step costs besides its layers and head (embeddings, final norm, the forward's own overhead).
    Timed on the same model built with two layers and with one: the difference is a layer. It holds
    what the matmul rates leave out: norms, attention, routing, the per-op cost of small tensors."""
    seconds = {layers: time_decode(shrunk(config, layers), dtype, device) for layers in (1, 2)}
    layer = {rows: max(seconds[2][rows] - seconds[1][rows], 0.0) for rows in LAYER_ROWS}
    return {"layer": layer, "step": {rows: max(seconds[1][rows] - layer[rows], 0.0) for rows in LAYER_ROWS}}


def shrunk(config, layers: int):
    """config with layers decoder layers and a tiny vocabulary (the head's cost is counted apart)."""
    import copy

    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    text.vocab_size = 256
    return config


@torch.inference_mode()
def time_decode(config, dtype: torch.dtype, device: Device) -> dict[int, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    target = device.torch_device
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(target).eval()
    generator = torch.Generator().manual_seed(0)
    times = {}
    for rows in LAYER_ROWS:
        cache = DynamicCache(config=config)
        model(torch.randint(0, 256, (rows, LAYER_CONTEXT), generator=generator).to(target), cache=cache, use_cache=True)
        step = torch.randint(0, 256, (rows, 1), generator=generator).to(target)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            model(step, cache=cache, use_cache=True)
            device.synchronize()
            best = min(best, time.perf_counter() - started)
            cache.crop(-1)  # the step's position out again: every repeat sees the same context
        times[rows] = best
    return times
