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
own groups are 32 wide keeps them exactly at 32). zerolite.speculative.draft_speed times its guesses
and sizes the ring beside it; zerolite.speculative.decoding runs the rounds of guessing and checking.
"""

from __future__ import annotations

from pathlib import Path

import psutil
from transformers import AutoConfig

from zerolite.convert.resolve import ensure_layout
from zerolite.convert.writer import convert
from zerolite.errors import ZeroliteError
from zerolite.hf import load_tokenizer
from zerolite.io.device import Device
from zerolite.layout.folder import Layout
from zerolite.runtime.budget import reserve

SELF_DRAFTS = {"self-int4": "int4", "self-int8": "int8"}
DRAFT_GROUP_SIZE = 32


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


def checked_draft_layout(spec: str, target: Layout, group_size: int | None, tokenizer, device: Device,
                         show_progress: bool) -> Path:
    """The draft's layout folder (draft_layout), once it shares the target's tokenizer and fits the
    memory left on device."""
    folder = draft_layout(spec, target, group_size, show_progress)
    check_same_vocabulary(tokenizer, AutoConfig.from_pretrained(target.side_folder), folder)
    check_draft_fits(Layout.open(folder), device)
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


def check_same_vocabulary(tokenizer, config, draft: Path) -> None:
    """A draft must speak the target's tokens (tokenizer and config: the target's, as loaded): the
    same tokenizer vocabulary, or, where the layouts carry no tokenizer, the same vocabulary size."""
    theirs = load_tokenizer(draft)
    if tokenizer is not None and theirs is not None:
        same = tokenizer.get_vocab() == theirs.get_vocab()
    else:
        same = (tokenizer is None and theirs is None and config.get_text_config().vocab_size
                == AutoConfig.from_pretrained(draft).get_text_config().vocab_size)
    if not same:
        raise ZeroliteError(f"the draft {draft} does not share the target's tokenizer: a draft must use the same "
                            "vocabulary as the model it drafts for (the same family, or `draft` self-int4)")
