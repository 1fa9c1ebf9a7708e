"""What one pass over a model costs, from its config alone: the bytes each block stores in each
weight format, the weights a token multiplies, and the K/V cache a token keeps.

    costs = ModelCosts.from_config(AutoConfig.from_pretrained("bigscience/bloom"))
    costs.formats["int4"].layer_bytes     # one decoder layer, as convert --weights int4 would store it

Built on a meta model (zerolite.hf.build_meta_model), with the same block partition
and the same quantization shapes convert uses, so the bytes are the layout's, not an estimate. A
mixture of experts' expert tensors (transformers keeps each layer's experts fused, [experts, ...])
are counted apart: a routed step reads and multiplies only the experts its tokens pick.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from zerolite.hf import build_meta_model
from zerolite.io.engine import ALIGNMENT
from zerolite.layout.blocks import module_path, partition, stored_tensors
from zerolite.memory_model import (
    KV_BITS,
    ModelShape,
    dense_weight_bytes,
    dequantize_workspace,
    kv_bytes_per_token,
    quantized_weight_count,
)
from zerolite.quant.quantize import WeightScheme, quantizable_linears

WEIGHT_FORMATS = ("stored", "int8", "int4")


@dataclass(frozen=True)
class FormatCosts:
    """One weight format's bytes: what a layer, the blocks always resident, and an expert store,
    and on a GPU what its quantized weights take dequantised."""
    layer_bytes: int        # the widest decoder layer, 4 KiB-aligned as a layout stores it
    always_bytes: int       # the embeddings, final norm and head (never quantized)
    expert_bytes: int       # one expert of one layer (0 for a dense model)
    dense_bytes: int = 0    # the widest layer's quantized weights dequantised, as a GPU keeps a resident layer's
    workspace_bytes: int = 0  # a GPU's dequantisation of streamed layers (zerolite.memory_model.dequantize_workspace)


@dataclass(frozen=True)
class ModelCosts:
    name: str
    dtype: torch.dtype
    layers: int
    formats: dict[str, FormatCosts]   # "stored" (the checkpoint's precision), and "int8", "int4" where they apply
    dense_weights: int                # weights a token multiplies in one layer, experts left out
    expert_weights: int               # weights of one expert of one layer
    experts: int                      # experts per layer (0: dense)
    experts_per_token: int
    head_weights: int                 # the output projection's, multiplied once per token
    attention_width: int              # query heads x head width: attention's cost per position of context (0: none)
    kv_bytes_per_token: int           # K and V of the layers that attend, for one position of one sequence
    shape: ModelShape                 # the sizes the activations depend on
    kv_bytes_at: dict[int, int]       # the same at each of --kv-bits (at 8 and 4, their scales included)

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype: torch.dtype | None = None, name: str = "") -> ModelCosts:
        text = config.get_text_config()
        dtype = dtype or getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        model = build_meta_model(config, dtype)
        parts = partition(model)
        tensors = stored_tensors(model)
        targets = quantizable_linears(model, parts.layers_path)
        experts = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0)
        layer_blocks = [b for b in parts.blocks if b.name.startswith("layers.")]
        always = sum(aligned(tensors[n].nbytes) for b in parts.blocks if b not in layer_blocks for n in b.tensor_names)

        def is_expert(name: str) -> bool:
            return (experts > 1 and ".experts." in name
                    and tensors[name].dim() >= 3 and tensors[name].shape[0] == experts)

        widest = max(layer_blocks, key=lambda b: sum(tensors[n].nbytes for n in b.tensor_names))
        layer = {n: tensors[n] for n in widest.tensor_names}
        expert_names = [n for n in layer if is_expert(n)]
        expert_weights = sum(layer[n].numel() for n in expert_names) // max(experts, 1)
        layer_linears = {path: shape for path, shape in targets.items()
                         if path.startswith(module_path(parts.layers_path, widest.name) + ".")}
        linear_weights = sum(shape.out_features * shape.in_features for shape in layer_linears.values())
        formats = {"stored": FormatCosts(aligned(sum(t.nbytes for t in layer.values())), always,
                                         sum(layer[n].nbytes for n in expert_names) // max(experts, 1))}
        for weights in ("int8", "int4"):
            scheme = WeightScheme.parse(weights)
            fitting = scheme.fitting(targets)
            stored = scheme.meta_tensors(layer, fitting)
            codes = [stored[path + ".weight"].nbytes for path in fitting if path + ".weight" in layer]
            counts = [quantized_weight_count(weights, nbytes) for nbytes in codes]
            formats[weights] = FormatCosts(
                aligned(sum(t.nbytes for t in stored.values())), always, formats["stored"].expert_bytes,
                dense_bytes=dense_weight_bytes(sum(counts), dtype),
                workspace_bytes=dequantize_workspace(weights, max(counts, default=0), dtype, sum(codes)),
            )
        shape = ModelShape.of(config)
        return cls(
            name=name or getattr(config, "_name_or_path", "") or config.model_type, dtype=dtype,
            layers=len(layer_blocks),
            formats=formats, dense_weights=linear_weights, expert_weights=expert_weights,
            experts=experts if expert_names else 0, experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0),
            head_weights=shape.vocab * shape.hidden, attention_width=shape.attention_width,
            kv_bytes_per_token=kv_bytes_per_token(config, dtype), shape=shape,
            kv_bytes_at={bits: kv_bytes_per_token(config, dtype, bits) for bits in KV_BITS},
        )

    def kv_bytes(self, bits: int) -> int:
        """K/V one position of one sequence keeps over every layer, at bits."""
        return self.kv_bytes_at[bits]

    def expected_experts(self, tokens: int) -> float:
        """Distinct experts a layer's router picks for tokens tokens, each picking experts_per_token
        of experts at random: the experts a routed step reads and multiplies."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT
