"""The arguments of one generate call, as a model whose weights stream takes them: checked before
anything runs, a cache under the name the installed transformers gives it, tensors on the model's
device, and a generation config that compiles nothing.

    kwargs = checked_arguments(model, input_ids, kwargs, speculating=False)
    args, kwargs = on_device(args, kwargs, device)
    config = streaming_config(model, kwargs, offload_kv=True)
"""

from __future__ import annotations

import copy

import torch
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from zerolite.errors import ZeroliteError
from zerolite.hf import cache_keyword
from zerolite.text import check_token_ids


def checked_arguments(model, input_ids, kwargs: dict, speculating: bool) -> dict:
    """generate's keyword arguments, the cache under the installed transformers' name for it
    (cache_renamed), once nothing in them is refused: token ids past the vocabulary, a static
    cache, and, speculating, a batch or what speculative decoding does not return."""
    check_token_ids(model.config, input_ids)
    kwargs = cache_renamed(kwargs)
    refuse_static_cache(model, kwargs)
    if speculating:
        if isinstance(input_ids, torch.Tensor) and input_ids.shape[0] > 1:
            raise ZeroliteError(f"speculative decoding runs at batch 1, and this batch has {input_ids.shape[0]} "
                                "prompts: give them one at a time, or leave out `draft` to batch them")
        asked = kwargs.get("generation_config") or model.generation_config
        beams = kwargs.get("num_beams", asked.num_beams) or 1  # transformers 5 leaves unset fields None
        if beams > 1 or kwargs.get("return_dict_in_generate", asked.return_dict_in_generate):
            raise ZeroliteError("speculative decoding decodes greedily or by sampling and returns token ids: "
                                "leave out num_beams and return_dict_in_generate, or load without a draft")
    return kwargs


def on_device(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """The tensors among generate's arguments, moved to the model's device."""
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    return args, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def streaming_config(model, kwargs: dict, offload_kv: bool):
    """The generation config the call runs with, put in kwargs where it had to change: compiling
    would capture one forward's weight addresses; and generate refuses a cache passed in beside a
    configured one (offload_kv: zerolite passes its own)."""
    config = kwargs.get("generation_config") or model.generation_config
    if not config.disable_compile or (offload_kv and config.cache_implementation is not None):
        config = kwargs["generation_config"] = copy.copy(config)
        config.disable_compile = True
        if offload_kv:
            config.cache_implementation = None
    return config


def with_cache(kwargs: dict, cache) -> dict:
    """generate's keyword arguments with cache passed in."""
    return {**kwargs, cache_keyword(): cache}


def returned_cache(output):
    """The cache generate's output carries (where it returns a dict), else None."""
    return getattr(output, cache_keyword(), None)


def cache_renamed(kwargs: dict) -> dict:
    """generate's arguments with a cache given under either name put under the one the installed
    transformers takes (zerolite.hf.cache_keyword): code written for either release runs on both."""
    other = "past_key_values" if cache_keyword() == "cache" else "cache"
    if other not in kwargs:
        return kwargs
    renamed = dict(kwargs)
    renamed[cache_keyword()] = renamed.pop(other)
    return renamed


def given_cache(kwargs: dict):
    """The cache a caller passed to generate (after cache_renamed)."""
    return kwargs.get(cache_keyword())


def refuse_static_cache(model, kwargs: dict) -> None:
    """zerolite rebinds each layer's weights to a slot's bytes at every forward; a static cache is
    there to capture the forward in CUDA graphs or torch.compile, which would keep the addresses
    of one forward's slots."""
    config = kwargs.get("generation_config") or model.generation_config
    asked = kwargs.get("cache_implementation") or getattr(config, "cache_implementation", None)
    cache = given_cache(kwargs)
    if asked in ALL_STATIC_CACHE_IMPLEMENTATIONS or (cache is not None and getattr(cache, "is_compileable", False)):
        raise ZeroliteError(
            f"a static cache ({asked or type(cache).__name__}) cannot run with streamed weights: zerolite rebinds "
            "each layer's weights at every forward, which CUDA graphs and torch.compile do not allow; use the default "
            "dynamic cache"
        )


def job_length(input_ids, kwargs: dict, config) -> int:
    """How many tokens a generate call's sequences reach at most (0 where that is not known)."""
    new = kwargs.get("max_new_tokens", config.max_new_tokens)
    if new is not None and isinstance(input_ids, torch.Tensor):
        return input_ids.shape[-1] + new
    return kwargs.get("max_length", config.max_length) or 0
