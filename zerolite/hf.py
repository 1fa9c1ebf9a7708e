"""transformers glue that every room shares: quiet logging, a layout's tokenizer, the model built on
the meta device (and made ready to run there), a mixture's experts kept as built, RWKV's rescaling
by one skipped, and what a model's cache cannot do (K/V offload, a draft's rewind)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from zerolite.errors import ZeroliteError

GENERATION_CONFIG = "generation_config.json"


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


def build_meta_model(config, dtype, real_buffers: bool = False):
    """The model's module tree with every parameter on the meta device: shapes and names, no memory.

    With real_buffers, buffers are real tensors on the CPU: the ones computed in __init__ rather
    than stored (rotary inv_freq and the like) are then ready to run with.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    empty = init_empty_weights(include_buffers=False) if real_buffers else torch.device("meta")
    try:
        with empty:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as e:
        raise ZeroliteError(
            f"model_type '{config.model_type}' is not a causal language model transformers knows "
            f"({' '.join(str(e).split())[:160]}); zerolite runs decoder-only LMs"
        ) from e


def runnable_model(folder: Path, dtype, device):
    """transformers' model for the config in folder: parameters on meta (for streamed weights to be
    bound to), buffers real on device (a torch.device), ready to run in eval mode.

    Compilation and CUDA graphs are off: they capture the addresses of the weights, which change
    every time a slot is rebound. A static cache that a config asks for by default (Gemma-2's
    "hybrid") gives way to the dynamic one, which zerolite's K/V offload also builds on.
    """
    from torch import nn
    from transformers import AutoConfig, GenerationConfig
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

    config = AutoConfig.from_pretrained(folder)
    model = build_meta_model(config, dtype, real_buffers=True)
    model.eval()
    model.requires_grad_(False)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)
    if (folder / GENERATION_CONFIG).is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.generation_config.disable_compile = True
    if model.generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        model.generation_config.cache_implementation = None
    keep_experts_implementation(model)
    skip_rescaling_by_one(model, config)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(contiguous_input)
    return model


def contiguous_input(module, args: tuple) -> tuple:
    """A Linear's input, made contiguous (a no-op when it is). On a CPU, torch runs linear on a
    strided 16-bit 3-D input whose weight does not require grad on a slow path that also expands
    the weight once per sequence, and the head applied to generate's last position
    (hidden[:, -1:, :]) is such an input: its time and memory then grow with the batch times the
    head (a copy of a 32000 x 256 bf16 head per sequence is 1 GB for 64 sequences). Copying that
    strided input costs next to nothing: one row per sequence."""
    return (args[0].contiguous(), *args[1:])


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


@functools.cache
def sliding_cache_rewinds() -> bool:
    """Whether a sliding-window cache layer can be rewound: up to 5.17, one recording its past (for
    a rewind) hands attention every key it holds, not the window its mask was made for, and
    speculative decoding's next pass fails in attention."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.18")


def refuse_what_its_cache_cannot_do(config, kv_option: str | None, draft: bool) -> None:
    """Said before anything loads, not as a forward's error (or, rewinding a state, wrong tokens):

    - a model whose forward makes a cache class of its own (MiniMax's, RWKV's state) refuses any
      other, and the cache kv_option (kv_offload, kv_bits or micro_batches) asks for and a draft's are
      DynamicCaches (transformers' own test for such models: _supports_default_dynamic_cache);
    - speculative decoding rewinds the target's cache past the guesses it rejects, which crop cannot
      do to a recurrent state (state-space, linear-attention and recurrent layers: transformers'
      LinearAttention cache layers, which are not is_croppable once they hold one), nor, before
      transformers 5.18, a sliding window's (sliding_cache_rewinds)."""
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    name = model_class.__name__ if model_class is not None else type(config).__name__
    if model_class is not None and not model_class._supports_default_dynamic_cache():
        if kv_option:
            what = {"kv_offload": "split between device and host memory", "kv_bits": "quantize",
                    "micro_batches": "split by rows"}[kv_option]
            raise ZeroliteError(f"{name} keeps its cache in a class of its own, which `{kv_option}` cannot {what}: "
                                f"leave out `{kv_option}`")
        raise ZeroliteError(f"{name} keeps its cache in a class of its own, which speculative decoding cannot rewind: "
                            "leave out `draft`")
    if draft:
        layers = DynamicCache(config=config.get_text_config(decoder=True)).layers
        if any(hasattr(layer, "recurrent_states") for layer in layers):  # LinearAttentionCacheLayerMixin's
            raise ZeroliteError(f"{name} has layers that carry a recurrent state, which speculative decoding cannot "
                                "rewind past the guesses it rejects: leave out `draft`")
        if not sliding_cache_rewinds() and any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ZeroliteError(f"{name} has sliding-window layers, whose cache transformers "
                                f"{transformers.__version__} cannot rewind past rejected guesses: upgrade it "
                                "(pip install 'transformers>=5.18'), or leave out `draft`")
