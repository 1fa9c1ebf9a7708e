"""Tiny random models built from transformers configs, for tests that must not touch a model hub."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
)

VOCAB = 128


def tiny_config(arch: str, layers: int = 3, tie: bool = True, **overrides) -> PretrainedConfig:
    """overrides: config fields for the tests that need a bigger or otherwise shaped model."""
    common = dict(vocab_size=VOCAB, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        config_class, shape = LlamaConfig, dict(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    elif arch == "mistral":
        config_class, shape = MistralConfig, dict(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=256, sliding_window=None)
    elif arch == "bloom":
        config_class, shape = BloomConfig, dict(hidden_size=64, n_layer=layers, n_head=4)
    elif arch == "opt":
        config_class, shape = OPTConfig, dict(hidden_size=64, ffn_dim=160, num_hidden_layers=layers, num_attention_heads=4,
                                              max_position_embeddings=256, word_embed_proj_dim=64)
    elif arch == "gpt2":
        config_class, shape = GPT2Config, dict(n_embd=64, n_layer=layers, n_head=4, n_positions=256)
    else:
        raise ValueError(arch)
    # Constructor arguments, not attributes set afterwards: configs derive fields (head_dim) from them.
    return config_class(**{**common, **shape, **overrides})


def build_tiny_model(arch: str, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """A model with weights scaled up from transformers' tiny default init, and norms and biases
    perturbed, so that outputs vary from token to token instead of repeating one (which would
    hide bugs) on every architecture here, BLOOM included."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_kwargs), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 4.0 / param.shape[-1] ** 0.5)
            else:
                param.add_(torch.randn_like(param), alpha=0.2)
    return model.eval()


def save_tiny_model(arch: str, folder: Path, **kwargs) -> Path:
    build_tiny_model(arch, **kwargs).save_pretrained(folder)
    return folder
