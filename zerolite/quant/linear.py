"""The modules quantized layers run with: a Linear whose weight is int8 or int4, its tensors bound
from a slot as views like any other block's, with no copy.

    install(model, manifest, device)   # swaps the layers' quantized Linear / Conv1D modules for them

Where host memory is the device's (a CPU), a decode step computes with torch's weight-only kernels
(aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu), which read the weight as stored:
nothing is dequantised or repacked per decode step. Those kernels' cost grows with the rows far
faster than a matmul's, so from a threshold of rows on (a prefill) the weight is dequantised once
for the call into the activations' dtype and an ordinary matmul runs. The int4 kernel is fast only
with bf16 activations (fp32 and fp16 take a scalar path, far slower than a dense matmul), so other dtypes
always dequantise. Where the device has memory of its own (a GPU), the quantized bytes are what
crosses the link (about a half or a quarter of bf16's), and they are always dequantised there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.layout.manifest import DTYPES, Manifest, TensorEntry
from zerolite.quant.int4_packing import Int4Packing, cpu_packing, unpack_int4
from zerolite.quant.quantize import (
    SCALE_SUFFIX,
    SCALE_ZERO_SUFFIX,
    WeightScheme,
    linear_shape,
    whole_groups,
)

# From these many rows on, dequantise-then-matmul beats the kernel: the kernel's cost grows with
# the rows far faster than a matmul's, while dequantising costs the same for one row as for many.
# int4's threshold is higher, as unpacking its nibbles costs more than widening int8. Where the
# two cross depends on the CPU; these were set from the CPUs measured (the README's figures).
DEQUANTIZE_ROWS = 64
INT4_DEQUANTIZE_ROWS = 512


class QuantizedLinear(nn.Module):
    """What the int8 and int4 modules share: the bias, and rows in and out."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dequantize: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dequantize = dequantize
        self.bias = bias
        self.dense: torch.Tensor | None = None  # the weight dequantised once, for a layer resident on a GPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # contiguous: the kernels read rows as they lie (mamba's projections are given a transposed input)
        rows = x.reshape(-1, self.in_features).contiguous()
        y = F.linear(rows, self.dense) if self.dense is not None else self.multiply(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight in dtype."""
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    def __init__(self, out_features: int, in_features: int, scale_dtype: torch.dtype, bias: torch.Tensor | None,
                 dequantize: bool):
        super().__init__(out_features, in_features, bias, dequantize)
        # Meta placeholders: the executor binds the stored int8 weight and its scales over them.
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.int8, device="meta"))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=scale_dtype, device="meta"))

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dequantize or rows.shape[0] >= DEQUANTIZE_ROWS:
            return F.linear(rows, self.dequantized(rows.dtype))
        scale = getattr(self, "weight" + SCALE_SUFFIX).to(rows.dtype)
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * getattr(self, "weight" + SCALE_SUFFIX).to(dtype)[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(QuantizedLinear):
    def __init__(self, out_features: int, in_features: int, scheme: WeightScheme, scale_dtype: torch.dtype,
                 bias: torch.Tensor | None, dequantize: bool):
        super().__init__(out_features, in_features, bias, dequantize)
        self.group_size = scheme.group_size
        self.packing = scheme.packing
        self.stored_in = whole_groups(in_features, self.group_size)  # a partial last group is stored padded
        self.register_buffer("weight", torch.empty((out_features, self.stored_in // 2), dtype=torch.uint8, device="meta"))
        self.register_buffer("weight" + SCALE_ZERO_SUFFIX, torch.empty(
            (self.stored_in // self.group_size, out_features, 2), dtype=scale_dtype, device="meta"))

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        scale_zero = getattr(self, "weight" + SCALE_ZERO_SUFFIX)
        if self.dequantize or rows.dtype != torch.bfloat16 or rows.shape[0] >= INT4_DEQUANTIZE_ROWS:
            return F.linear(rows, self.dequantized(rows.dtype))
        # Zeros against the padding columns: whatever those hold, they add nothing.
        rows = F.pad(rows, (0, self.stored_in - self.in_features)) if self.stored_in > self.in_features else rows
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, scale_zero.to(rows.dtype))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        scale_zero = getattr(self, "weight" + SCALE_ZERO_SUFFIX)
        return dequantize_int4(self.weight, scale_zero, self.group_size, self.packing, dtype)[:, : self.in_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group_size={self.group_size}"


def dequantize_int4(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int, packing: Int4Packing,
                    dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in dtype: (q - 8) * scale + zero, group by group, on packed's device."""
    groups, out_features, _ = scale_zero.shape
    q = unpack_int4(packed, out_features, groups * group_size, packing)
    scale_zero = scale_zero.to(dtype).transpose(0, 1)  # [out, groups, 2]
    weight = (q.reshape(out_features, groups, group_size).to(dtype) - 8) * scale_zero[..., :1] + scale_zero[..., 1:]
    return weight.reshape(out_features, groups * group_size)


def install(model: nn.Module, manifest: Manifest, device: Device) -> None:
    """Replaces every module whose weight the layout stores quantized (it has a companion tensor)."""
    if manifest.quantization is None:
        return
    scheme = WeightScheme.from_manifest(manifest.quantization)
    scale_dtype = DTYPES[manifest.dtype]
    if scheme.name == "int4" and not device.separate_memory and scale_dtype == torch.bfloat16:
        check_packing(scheme)
    for block in manifest.blocks:
        for weight in quantized_weights(manifest, block.name):
            parent_path, _, leaf = weight.name.removesuffix(".weight").rpartition(".")
            parent = model.get_submodule(parent_path)
            original = getattr(parent, leaf)
            bias = getattr(original, "bias", None)
            shape = linear_shape(original)
            if scheme.name == "int8":
                module = Int8Linear(shape.out_features, shape.in_features, scale_dtype, bias, device.separate_memory)
            else:
                module = Int4Linear(shape.out_features, shape.in_features, scheme, scale_dtype, bias,
                                    device.separate_memory)
            setattr(parent, leaf, module)


def quantized_weights(manifest: Manifest, name: str) -> list[TensorEntry]:
    """The quantized weights a block holds (each has a companion tensor of scales)."""
    if manifest.quantization is None:
        return []
    companion = WeightScheme.from_manifest(manifest.quantization).companion
    tensors = manifest.block(name).tensors
    names = {tensor.name for tensor in tensors}
    return [tensor for tensor in tensors if tensor.name + companion in names]


def weight_count(manifest: Manifest, tensor: TensorEntry) -> int:
    """How many weights a quantized tensor holds (int4 packs two a byte)."""
    return tensor.nbytes * (2 if manifest.quantization["weights"] == "int4" else 1)


def quantized_modules(model: nn.Module, manifest: Manifest, names) -> list[QuantizedLinear]:
    """The quantized modules whose weights these blocks hold."""
    return [model.get_submodule(tensor.name.removesuffix(".weight"))
            for name in names for tensor in quantized_weights(manifest, name)]


def keeps_dense(device: Device, offload: str) -> bool:
    """Whether resident quantized weights are kept dequantised: on a GPU, unless every layer is
    resident (offload none), where the quantized form is what makes the model fit."""
    return device.separate_memory and offload != "none"


def dequantize_resident(model: nn.Module, manifest: Manifest, names) -> None:
    """On a GPU, the quantized layers held there are dequantised once, as they are bound: their
    quantized bytes saved only the link's time, and dequantising them at every call would cost the
    time and the temporaries again and again (the plan counts the dense copies: dense_bytes)."""
    for module in quantized_modules(model, manifest, names):
        module.dense = module.dequantized(DTYPES[manifest.dtype])


def dense_bytes(manifest: Manifest, name: str) -> int:
    """The bytes a block's quantized weights take dequantised, in the layout's dtype."""
    itemsize = DTYPES[manifest.dtype].itemsize
    return sum(weight_count(manifest, tensor) for tensor in quantized_weights(manifest, name)) * itemsize


def dequantize_workspace(manifest: Manifest) -> int:
    """The most device memory a streamed quantized layer's call takes for dequantising on a GPU:
    one weight at a time, in the layout's dtype, with the temporaries its dequantisation makes
    (int8: the widened weight and the scaled one; int4: the unpacked codes, then two widened)."""
    if manifest.quantization is None:
        return 0
    itemsize = DTYPES[manifest.dtype].itemsize
    per_weight = 1 + 2 * itemsize if manifest.quantization["weights"] == "int4" else 2 * itemsize
    counts = [weight_count(manifest, tensor) for block in manifest.blocks for tensor in quantized_weights(manifest, block.name)]
    return max(counts, default=0) * per_weight


def check_packing(scheme: WeightScheme) -> None:
    """The CPU int4 kernel reads its own packed order: a layout packed for another torch or another
    kind of CPU would compute garbage there, so it is refused."""
    here = cpu_packing()
    if scheme.packed_by != torch.__version__ or scheme.packing != here:
        raise ZeroliteError(
            f"this layout's int4 weights were packed by torch {scheme.packed_by} in {scheme.packing.block_rows}-row "
            f"blocks, which torch {torch.__version__}'s int4 kernel does not read on this CPU (it wants "
            f"{here.block_rows}-row blocks from torch {torch.__version__}): convert the model again with `weights` int4"
        )
