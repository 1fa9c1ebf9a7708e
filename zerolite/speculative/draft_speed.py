"""How the draft runs beside the streamed model: its head quantized to guess faster, how long one
guess takes, and the ring deep enough for the disk to read on while it guesses.

    quantize_head(draft_lm)                                      # a self-draft on a CPU
    depth = ring_depth(policy, layout, draft_lm, draft_step_s(draft_lm))
"""

from __future__ import annotations

import math
import time

import torch

from zerolite.hf import cache_keyword
from zerolite.layout.folder import Layout
from zerolite.layout.read_pass import read_pass
from zerolite.quant.linear import Int8Linear
from zerolite.quant.quantize import SCALE_SUFFIX, quantize_int8
from zerolite.runtime.policy import Policy
from zerolite.speculative.decoding import LONGEST_DRAFT, one_thread
from zerolite.speculative.draft import memory_left

RATE_PROBE_BYTES = 256 << 20  # read twice at load to size the ring: a few tenths of a second


def quantize_head(draft_lm) -> None:
    """A self-draft's head in int8, quantized as it loads: a small model's head is a large share
    of its weights (the built-in model's is 49152 x 576), and in bf16 a large share of each guess.
    The model's own head still decides every token; the draft's only has to guess it. int8, not
    int4, even for an int4 draft: an int4 head makes far more of the guesses the target rejects,
    each of which costs a round."""
    model = draft_lm.model
    head = model.get_output_embeddings()
    weight = head.weight.detach()
    q, scale = quantize_int8(weight.cpu())
    module = Int8Linear(weight.shape[0], weight.shape[1], weight.dtype, head.bias,
                        dequantize=draft_lm.device.separate_memory)
    module.weight = q.to(weight.device)
    setattr(module, "weight" + SCALE_SUFFIX, scale.to(weight.device))
    model.set_output_embeddings(module)


def draft_step_s(draft_lm, steps: int = 4) -> float:
    """How long one guess takes: the draft's forward of one token after a short prompt, timed once
    it is warm (DraftLength starts from it, and ring_depth sizes the reads ahead with it)."""
    from transformers import DynamicCache

    cache = {cache_keyword(): DynamicCache(config=draft_lm.config)}
    token = torch.ones((1, 1), dtype=torch.long, device=draft_lm.torch_device)
    with torch.no_grad(), one_thread():  # as the rounds run it
        draft_lm.model(input_ids=token.repeat(1, 8), use_cache=True, **cache)
        draft_lm.model(input_ids=token, use_cache=True, **cache)
        draft_lm.device.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            draft_lm.model(input_ids=token, use_cache=True, **cache)
        draft_lm.device.synchronize()
    return (time.perf_counter() - started) / steps


def ring_depth(policy: Policy, layout: Layout, draft_lm, step_s: float) -> int:
    """The ring's depth beside a draft: while the draft guesses, the model computes nothing, and
    without slots to read into the disk would idle. Deep enough for what the disk reads through
    the longest round of guesses, at the rate a short read-only pass of our engine over the last
    layers (the ones streamed when memory holds the first) measures; never shallower than asked,
    short of the layers by one, and taking at most half the memory left. Where the disk reads
    many layers in a round (small layers, slow guesses) that is all but one layer; where a layer
    takes longer to read than a round, a slot or two more than asked."""
    manifest = layout.manifest
    layers = manifest.layer_names
    slot = max((manifest.block(name).length for name in layers), default=0)
    if policy.offload != "nvme" or slot == 0:
        return policy.prefetch_depth
    probe = [layers[-1]]
    for name in reversed(layers[:-1]):
        if manifest.nbytes(probe + [name]) > RATE_PROBE_BYTES:
            break
        probe.append(name)
    gbps = read_pass(layout, probe, passes=2)["read_gbps"]
    wanted = 1 + math.ceil(LONGEST_DRAFT * step_s * gbps * 1e9 / slot)
    affordable = memory_left(draft_lm.device)[0] // 2 // slot
    # Fewer slots than layers: a ring that held them all would keep the model, not stream it.
    return max(policy.prefetch_depth, min(wanted, len(layers) - 1, affordable))
