"""The module quantized layers run with: a Linear whose weight is int8 with one scale per output
channel, its tensors bound from a slot as views like any other block's, with no copy.

    install(model, manifest, device)   # swaps the layers' quantized Linear / Conv1D modules for it

Where host memory is the device's (a CPU), a decode step computes with torch's weight-only int8
kernel (aten._weight_int8pack_mm), which reads the int8 weight as stored: nothing is dequantised
or repacked per decode step. That kernel's cost grows with the rows far faster than a matmul's,
so from DEQUANTIZE_ROWS rows on (a prefill) the weight is dequantised once for the call into the
activations' dtype and an ordinary matmul runs. Where the device has memory of its own (a GPU),
the int8 bytes are what crosses the link (about half of bf16's), and they are always dequantised
there for the matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolite.device import Device
from zerolite.manifest import DTYPES, Manifest
from zerolite.quantize import SCALE_SUFFIX

# From this many rows the dequantise-then-matmul path beats the int8 kernel on the CPUs measured:
# one 5632 x 2048 matrix took 0.6 ms (1 row), 5.5 ms (16) and 21.8 ms (128) in the kernel against
# 2.9 ms (16) and 7.9 ms (128) as a bf16 matmul; scoring 4096 rows through the kernel took 22x
# the fp32 model's time.
DEQUANTIZE_ROWS = 64


class QuantizedLinear(nn.Module):
    def __init__(self, out_features: int, in_features: int, scale_dtype: torch.dtype, bias: torch.Tensor | None,
                 dequantize: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dequantize = dequantize
        # Meta placeholders: the executor binds the stored int8 weight and its scales over them.
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.int8, device="meta"))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=scale_dtype, device="meta"))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # contiguous: the kernel reads rows as they lie
        scale = getattr(self, "weight" + SCALE_SUFFIX).to(x.dtype)
        if self.dequantize or rows.shape[0] >= DEQUANTIZE_ROWS:
            y = F.linear(rows, self.weight.to(x.dtype) * scale[:, None])
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def install(model: nn.Module, manifest: Manifest, device: Device) -> None:
    """Replaces every module whose weight the layout stores quantized (it has a P.weight_scale)."""
    if manifest.quantization is None:
        return
    scale_dtype = DTYPES[manifest.dtype]
    for block in manifest.blocks:
        shapes = {t.name: t.shape for t in block.tensors}
        for name in shapes:
            if not name.endswith(".weight" + SCALE_SUFFIX):
                continue
            path = name.removesuffix(".weight" + SCALE_SUFFIX)
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            original = getattr(parent, leaf)
            out_features, in_features = shapes[path + ".weight"]
            setattr(parent, leaf, QuantizedLinear(out_features, in_features, scale_dtype,
                                                  getattr(original, "bias", None), dequantize=device.separate_memory))
