"""How fast this machine multiplies weights: seconds per weight element, by weight format and by
the rows multiplied at once, with the very modules a run uses (nn.Linear, on a CPU through
zerolite's bf16 kernel as a run's are, and zerolite's Int8Linear and Int4Linear with their CPU
kernels), so a CPU's kernel quirks (int4's bf16-only fast path, a bf16 matmul without AVX-512 BF16)
are measured, not assumed.

    rates = probe_compute(CpuDevice(), torch.bfloat16)
    # {"stored": {1: 2.1e-10, 4: ..., ...}, "int8": ..., "int4": ...}

The weights cycle through several matrices larger than a CPU's caches together, as a pass over a
model's layers does, so a small batch pays for reading its weights from memory. The matrices are
copies of one (random, then quantized once per format): their values do not change a matmul's
time, their separate memory does, and generating and quantizing six of them took a second.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from zerolite.hf import build_meta_model, cache_keyword
from zerolite.io.device import Device
from zerolite.planner.shrunk_config import PROBE_VOCAB, shrunk
from zerolite.quant.bf16_linear import use_bf16_kernel
from zerolite.quant.linear import Int4Linear, Int8Linear
from zerolite.quant.quantize import SCALE_SUFFIX, SCALE_ZERO_SUFFIX, WeightScheme

ROWS = (1, 4, 16, 64, 256, 1024)
SHAPE = (4096, 4096)        # out, in: a mid-sized model's projection
MATRICES = 6                # 6 x 32 MB in bf16: beyond the caches, as a layer's weights are
MIN_SECONDS = 0.05          # each point timed over this long at least (one call, at large batches)


def probe_compute(device: Device, dtype: torch.dtype,
                  formats=("stored", "int8", "int4")) -> dict[str, dict[int, float]]:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(SHAPE, generator=generator).to(dtype)
    rates = {}
    for weights in formats:
        one = module_for(weights, dense, device)
        modules = [one] + [copy.deepcopy(one) for _ in range(MATRICES - 1)]
        rates[weights] = {rows: seconds_per_weight(modules, rows, dtype, device) for rows in ROWS}
    return rates


def module_for(weights: str, weight: torch.Tensor, device: Device) -> nn.Module:
    out_features, in_features = weight.shape
    target = device.torch_device
    if weights == "stored":
        linear = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=weight.dtype)
        linear.weight = nn.Parameter(weight.to(target), requires_grad=False)
        if not device.separate_memory:  # a CPU run's stored linears go through zerolite's bf16 kernel
            use_bf16_kernel(linear)
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
    modules[0](x)  # kernels chosen
    calls, started = 0, time.perf_counter()
    while True:
        for module in modules:  # a pass at most between waits: a GPU's queue holds no more
            module(x)
            calls += 1
            if time.perf_counter() - started >= MIN_SECONDS:
                break
        device.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= MIN_SECONDS:
            return elapsed / calls / (SHAPE[0] * SHAPE[1])


LAYER_ROWS = (1, 16, 64, 256)   # the cost model interpolates between them, and past the last on a line through two
LAYER_CONTEXT = 2            # positions prefilled before the timed steps: attention's flops are priced apart, and a
                             # longer prompt made the prefill at 256 rows the larger part of the probe
LAYER_STEPS = 2              # decode steps timed at each row count, after one untimed
PROBED_LAYERS = 2            # a layer of each of the two commonest kinds (sliding and full attention, state space
                             # and attention)
PROBE_SECONDS = 3.0          # no row count is begun that would take the probe past this (the first two always run)
PROBE_LAYER_MAX_BYTES = 1 << 30  # larger layers are left to the matmul rates (their matmuls dwarf the rest)
FILL_PATTERN = 1 << 20       # random values tiled over every weight: memcpy's speed, not a random generator's


def probe_layer(config, dtype: torch.dtype, device: Device) -> dict[str, dict[int, float]]:
    """{"layer": seconds, "step": seconds} by batch size: what one of the model's own decoder layers
    takes for a decode step (one new position per sequence, about LAYER_CONTEXT cached), and what the
    step costs besides its layers and head (embeddings, final norm, the forward's own overhead).
    It holds what the matmul rates leave out: norms, attention, routing, the per-op cost of small
    tensors. Timed on the model built with PROBED_LAYERS of its layers (zerolite.planner.shrunk_config:
    a layer's time is theirs, weighed by the share of the model's layers each stands for), its
    weights a tiled pattern, each layer's time taken by hooks at its edges. Row counts are probed
    in turn while PROBE_SECONDS allows."""
    from zerolite.layout.blocks import find_decoder_layers

    small, shares = shrunk(config, PROBED_LAYERS)
    model = filled_model(small, dtype, device)
    # the text model's: a vision tower's may weigh more than 2 layers
    layers = find_decoder_layers(model.get_decoder())[1]
    clock = LayerClock(layers, shares, device)
    generator = torch.Generator().manual_seed(0)
    layer, step, spent = {}, {}, {}
    for rows in LAYER_ROWS:
        if len(spent) >= 2 and sum(spent.values()) + predicted(spent, rows) > PROBE_SECONDS:
            break
        started = time.perf_counter()
        layer[rows], step[rows] = time_decode(model, clock, rows, generator, device)
        spent[rows] = time.perf_counter() - started
    return {"layer": layer, "step": step}


def predicted(spent: dict[int, float], rows: int) -> float:
    """Seconds the probe at rows would take, extended in a line from the last two row counts'
    (flat while reading the weights dominates, in proportion to rows once the matmuls do)."""
    (before, before_s), (last, last_s) = sorted(spent.items())[-2:]
    return last_s + max(last_s - before_s, 0.0) * (rows - last) / (last - before)


def filled_model(config, dtype: torch.dtype, device: Device) -> nn.Module:
    """The model with every parameter in fresh memory on the device, holding a small random pattern
    (of transformers' usual initializer_range) over and over: transformers' random initialisation
    takes seconds for each layer of a 26 GB model, and uninitialised memory may hold NaNs and
    denormals, whose slow paths would be timed instead."""
    from zerolite.hf import quiet_transformers

    quiet_transformers()  # the tiny vocabulary draws warnings about token ids beyond it
    model = build_meta_model(config, dtype, real_buffers=True)
    target = device.torch_device
    pattern = (torch.randn(FILL_PATTERN, generator=torch.Generator().manual_seed(0)) * 0.02).to(target)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in made:  # tied weights stay tied
                made[id(param)] = nn.Parameter(tiled(pattern, param.shape, param.dtype), requires_grad=False)
            module._parameters[name] = made[id(param)]
    if not device.separate_memory:  # as a CPU run's model computes (zerolite.runtime.parts)
        use_bf16_kernel(model)
    return model.to(target).eval()


def tiled(pattern: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=pattern.device)
    flat, source = tensor.view(-1), pattern.to(dtype)
    whole = flat.numel() // source.numel() * source.numel()
    flat[:whole].view(-1, source.numel()).copy_(source.expand(whole // source.numel(), -1))  # one copy, on every core
    flat[whole:].copy_(source[:flat.numel() - whole])
    return tensor


class LayerClock:
    """Seconds spent inside each decoder layer in a forward, from hooks at its edges that wait for
    the device, so that a GPU's queued work is counted where it runs."""

    def __init__(self, layers: nn.ModuleList, shares: list[float], device: Device):
        self.shares, self.device, self.entered = shares, device, 0.0
        self.seconds = [0.0] * len(layers)
        for index, module in enumerate(layers):
            module.register_forward_pre_hook(self.enter)
            module.register_forward_hook(lambda module, args, output, index=index: self.leave(index))

    def enter(self, module, args) -> None:
        self.device.synchronize()
        self.entered = time.perf_counter()

    def leave(self, index: int) -> None:
        self.device.synchronize()
        self.seconds[index] += time.perf_counter() - self.entered

    def layer(self) -> float:
        """A layer's seconds in the last forward: the layers', weighed by the shares they stand for."""
        return sum(seconds * share for seconds, share in zip(self.seconds, self.shares)) / sum(self.shares)


@torch.inference_mode()
def time_decode(model: nn.Module, clock: LayerClock, rows: int, generator: torch.Generator,
                device: Device) -> tuple[float, float]:
    """(one layer's seconds, the rest of the step's) for a decode step of rows sequences, the best of
    LAYER_STEPS. Each step decodes the next position with the cache (or state) the model made
    itself: nothing is rolled back, as a sliding window's or a recurrent state's cache cannot be."""
    target = device.torch_device
    prompt = torch.randint(0, PROBE_VOCAB, (rows, LAYER_CONTEXT), generator=generator).to(target)
    cache = carried(model(prompt, use_cache=True))
    layer = step = float("inf")
    for repeat in range(LAYER_STEPS + 1):
        token = torch.randint(0, PROBE_VOCAB, (rows, 1), generator=generator).to(target)
        clock.seconds = [0.0] * len(clock.seconds)
        started = time.perf_counter()
        cache = carried(model(token, use_cache=True, **cache))
        device.synchronize()
        whole = time.perf_counter() - started
        if repeat:  # the first step after a prefill picks its kernels
            layer = min(layer, clock.layer())
            step = min(step, max(whole - sum(clock.seconds), 0.0))
    if layer <= 0:
        raise RuntimeError(f"{type(model).__name__}'s forward did not run its decoder layers as modules")
    return layer, step


def carried(output) -> dict:
    """The output's cache as the next step takes it (zerolite.hf.cache_keyword), or RWKV's `state`.
    A model that returns neither keeps its state in its modules (RecurrentGemma) and starts it
    afresh at a call without a cache: its steps are then one-token prompts, the same work bar
    attention's few cached positions."""
    return {name: output[name] for name in (cache_keyword(), "state") if output.get(name) is not None}
