"""The draft of speculative decoding: a small model held resident beside the streamed target,
whose guesses the target checks several at a time, in one pass over its weights.

    folder = draft_layout("self-int4", target_layout, group_size=None, show_progress=True)
    check_same_vocabulary(target_tokenizer, target_config, folder)

--draft PATH names a layout or checkpoint that shares the target's tokenizer. --draft self-int4 or
self-int8 is the target's own weights quantized: converted once from the source the target was
converted from, into a layout beside the target's (TARGET-draft-int4-g32), so no second model is
needed. A self-draft is bf16, the dtype the CPU int4 and int8 kernels run fast in (in fp32 they
are far slower). int4 is in groups of 32 by default: a draft is read from memory, so the finer
groups' scales cost little, while every guess the target rejects costs a round, and the finer the
groups, the more often the draft's top token is the target's (a model converted from a GGUF whose
own groups are 32 wide keeps them exactly at 32). zerolite.speculative.decoding runs the rounds of
guessing and checking.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import psutil
import torch

from zerolite.convert.resolve import ensure_layout
from zerolite.convert.writer import convert
from zerolite.errors import ZeroliteError
from zerolite.hf import cache_keyword, load_tokenizer
from zerolite.io.device import Device
from zerolite.layout.folder import Layout
from zerolite.layout.read_pass import read_pass
from zerolite.quant.linear import Int8Linear
from zerolite.quant.quantize import SCALE_SUFFIX, quantize_int8
from zerolite.runtime.budget import reserve
from zerolite.runtime.policy import Policy
from zerolite.speculative.decoding import LONGEST_DRAFT, one_thread

SELF_DRAFTS = {"self-int4": "int4", "self-int8": "int8"}
DRAFT_GROUP_SIZE = 32
RATE_PROBE_BYTES = 256 << 20  # read twice at load to size the ring: a few tenths of a second


def draft_layout(spec: str, target: Layout, group_size: int | None, show_progress: bool) -> Path:
    """The folder of the draft's layout, converted first where it is a self-draft or a checkpoint."""
    if spec not in SELF_DRAFTS:
        if group_size is not None:
            raise ZeroliteError("`draft_group_size` is for self-int4 drafts: leave it out with `draft` PATH")
        return ensure_layout(spec, None, None, False, show_progress)
    weights = SELF_DRAFTS[spec]
    if weights == "int8" and group_size is not None:
        raise ZeroliteError("`draft_group_size` is for self-int4 drafts: int8 has one scale per output channel")
    group_size = (group_size or DRAFT_GROUP_SIZE) if weights == "int4" else None
    own = target.manifest.quantization or {}
    if own.get("weights") == weights and own.get("group_size") == group_size:
        raise ZeroliteError(f"the target layout is {spec.removeprefix('self-')} already, so `draft` {spec} would "
                            "be the target itself: draft with a smaller model (`draft` PATH), or stream it without "
                            "`draft`")
    folder = target.folder.with_name(f"{target.folder.name}-draft-{weights}"
                                     + (f"-g{group_size}" if group_size else ""))
    convert(target.manifest.source["model"], folder, dtype="bf16", weights=weights, group_size=group_size,
            show_progress=show_progress)
    return folder


def check_draft_fits(draft: Layout, device: Device) -> None:
    """A draft is held whole where the model computes: it must fit the memory left there, less the
    reserve the model's own run keeps for activations and the K/V cache (zerolite.runtime.budget)."""
    needed = draft.manifest.nbytes(block.name for block in draft.manifest.blocks)
    left, where = memory_left(device)
    if needed > left:
        raise ZeroliteError(f"the draft {draft.folder} holds {needed / 1e9:.2f} GB, more than the "
                            f"{left / 1e9:.2f} GB of {where} left beside the model's run: draft with a smaller model, "
                            "or with self-int4 (about a quarter of bf16's bytes)")


def memory_left(device: Device) -> tuple[int, str]:
    """(bytes, where): what a resident draft may take on device, after the run's reserve."""
    if device.separate_memory:
        free, total = device.memory()
        return max(free - reserve(total), 0), f"{device.name} memory"
    memory = psutil.virtual_memory()
    return max(memory.available - reserve(memory.total), 0), "host memory"


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


def check_same_vocabulary(tokenizer, config, draft: Path) -> None:
    """A draft must speak the target's tokens (tokenizer and config: the target's, as loaded): the
    same tokenizer vocabulary, or, where the layouts carry no tokenizer, the same vocabulary size."""
    from transformers import AutoConfig

    theirs = load_tokenizer(draft)
    if tokenizer is not None and theirs is not None:
        same = tokenizer.get_vocab() == theirs.get_vocab()
    else:
        same = (tokenizer is None and theirs is None and config.get_text_config().vocab_size
                == AutoConfig.from_pretrained(draft).get_text_config().vocab_size)
    if not same:
        raise ZeroliteError(f"the draft {draft} does not share the target's tokenizer: a draft must use the same "
                            "vocabulary as the model it drafts for (the same family, or `draft` self-int4)")
