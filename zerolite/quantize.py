"""Weight quantization at convert time: which tensors are quantized, and how.

    scheme = WeightScheme.parse("int8")                    # None: the layout's dtype, as before
    targets = quantizable_linears(meta_model, "model.layers")   # {module path: (out, in, transposed)}
    tensors = scheme.quantize_block(tensors, targets)      # P.weight -> int8 P.weight + P.weight_scale

Every Linear inside the decoder layers (and transformers' Conv1D, GPT-2's Linear with its weight
stored transposed) is quantized; embeddings, norms, biases and the head keep the layout's dtype.
int8 is symmetric per output channel: weight = q * scale, q in [-127, 127], one scale per output
row. The quantized weight is always stored [out, in], whatever the module stored, so one module
(zerolite.quantized_linear) runs both. The tensors are plain and machine-independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from zerolite.errors import ZeroliteError
from zerolite.manifest import QUANTIZED_WEIGHTS

SCALE_SUFFIX = "_scale"  # P.weight's scale is stored as P.weight_scale


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    transposed: bool   # the module stores its weight [in, out] (Conv1D)


@dataclass(frozen=True)
class WeightScheme:
    name: str   # "int8"

    @classmethod
    def parse(cls, weights: str | None, group_size: int | None = None) -> WeightScheme | None:
        if weights is None:
            if group_size is not None:
                raise ZeroliteError("--group-size is for quantized weights: give --weights too")
            return None
        if weights == "int4":
            raise ZeroliteError("--weights int4 is not built yet: use --weights int8, or the layout's dtype")
        if weights not in QUANTIZED_WEIGHTS:
            raise ZeroliteError(f"unknown --weights {weights!r}: choose int8 (or leave it out for the layout's dtype)")
        if group_size is not None:
            raise ZeroliteError("--group-size is for int4's groups: int8 has one scale per output channel")
        return cls(weights)

    def to_manifest(self) -> dict:
        return {"weights": self.name, "scale": "symmetric, per output channel"}

    def quantize_block(self, tensors: dict[str, torch.Tensor], targets: dict[str, LinearShape]) -> dict[str, torch.Tensor]:
        """The block's tensors with each target module's weight quantized (others unchanged)."""
        out = {}
        for name, tensor in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in targets:
                weight = tensor.t() if targets[module].transposed else tensor
                out[name], out[name + SCALE_SUFFIX] = quantize_int8(weight)
            else:
                out[name] = tensor
        return out

    def meta_tensors(self, tensors: dict[str, torch.Tensor], targets: dict[str, LinearShape]) -> dict[str, torch.Tensor]:
        """What quantize_block makes, as meta tensors: the shapes a layout is planned from."""
        out = {}
        for name, tensor in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in targets:
                shape = targets[module]
                out[name] = torch.empty((shape.out_features, shape.in_features), dtype=torch.int8, device="meta")
                out[name + SCALE_SUFFIX] = torch.empty(shape.out_features, dtype=tensor.dtype, device="meta")
            else:
                out[name] = tensor
        return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with weight ~ q * scale[:, None]: rounding to nearest, in fp32, per output row."""
    rows = weight.float()
    scale = rows.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(weight.dtype)


def quantizable_linears(model: nn.Module, layers_path: str) -> dict[str, LinearShape]:
    """The Linear and Conv1D modules inside the decoder layers, by module path."""
    layers = model.get_submodule(layers_path)
    found = {}
    for path, module in layers.named_modules():
        full = f"{layers_path}.{path}"
        if isinstance(module, nn.Linear):
            found[full] = LinearShape(module.out_features, module.in_features, transposed=False)
        elif isinstance(module, Conv1D):
            found[full] = LinearShape(module.nf, module.weight.shape[0], transposed=True)
    return found
