"""transformers glue that every room shares: quiet logging, a layout's tokenizer, a mixture's experts
kept as built, RWKV's rescaling by one skipped."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from zerolite.errors import ZeroliteError


def quiet_transformers() -> None:
    """transformers' and the hub's own bars and warnings would bury zerolite's progress on stderr."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    disable_progress_bars()


@functools.cache
def cache_keyword() -> str:
    """What transformers calls the K/V cache in forward, generate and their outputs: `cache` in its
    later 5.x releases, `past_key_values` up to 5.17 (the GPU machines' image), where a `cache=`
    is refused as an unused argument. Every call site asks here rather than naming either."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def load_tokenizer(folder: Path):
    """The layout's tokenizer, padding on the left as decoder-only generation needs; None if it has none."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ZeroliteError(f"cannot read the tokenizer in {folder} ({' '.join(str(e).split())[:160]})") from e
    tokenizer.padding_side = "left"
    return tokenizer


def keep_experts_implementation(model) -> None:
    """While it decodes on any device but the CPU, transformers' generate swaps a mixture's
    grouped_mm experts for batched_mm (its _optimize_model_for_decode), which gathers a copy of
    each routed expert per token and pick: gigabytes of temporaries per layer at batch 8 for a
    Mixtral, which no budget counts, and tokens that may differ from the server's, which calls
    forward and keeps grouped_mm. The model keeps the implementation it was built with."""
    model._optimize_model_for_decode = contextlib.nullcontext


def rescales_weights(config) -> bool:
    """Whether the model divides some layer's weights in place at its first forward in eval mode:
    RWKV's _rescale_layers divides block i's output and value weights by 2 ** (i // rescale_every),
    by more than 1 only where there are more blocks than rescale_every."""
    every = getattr(config, "rescale_every", 0) or 0
    return config.model_type == "rwkv" and every > 0 and config.num_hidden_layers > every


def skip_rescaling_by_one(model, config) -> None:
    """Where every divisor would be 1, RWKV's first forward is told its layers are rescaled already:
    dividing an int8 or int4 weight in place, even by 1, is a dtype error (and a streamed layer's
    weights are bound afresh at each pass anyway)."""
    if config.model_type == "rwkv" and not rescales_weights(config):
        for module in model.modules():
            if hasattr(module, "layers_are_rescaled"):
                module.layers_are_rescaled = True
