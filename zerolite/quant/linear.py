"""The modules quantized layers run with: a Linear whose weight is int8 or int4, its tensors bound
from a slot as views like any other block's, with no copy.

    install(model, manifest, device)   # swaps the layers' quantized Linear / Conv1D modules for them

Where host memory is the device's (a CPU), a decode step computes with zerolite's own kernels
(zerolite.quant.cpu_kernels), which read the weight as stored, in any int4 packing a layout
records: nothing is dequantised or repacked per decode step. (torch's weight-only kernels,
aten._weight_int4pack_mm_for_cpu and _weight_int8pack_mm, ran tens of times slower on 2 threads:
docs/benchmarks-cpu-kernels.md.) Their cost grows with the rows like a matmul's without its
blocking for the cache, so from a threshold of rows on (a prefill) the weight is dequantised once
for the call into the activations' dtype and torch's matmul runs (oneDNN: AMX or AVX-512 in bf16).
Where the device has memory of its own (a GPU), the quantized bytes are what
crosses the link (about a half or a quarter of bf16's). There int4 multiplies through torch's fused
kernel (zerolite.quant.gpu_int4) below FUSED_INT4_ROWS rows, its packed form made once per slot fill
(the first call after the weight is bound) and dropped when the block is unbound; from that many
rows on, and for int8 always (torch's fused int8 kernel lost to dequantising at every row count
measured: docs/design-figures.md), the weight is dequantised into one buffer the model's layers
share (Scratch), in as few passes over it as the format allows, and an ordinary matmul runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolite import memory_model
from zerolite.io.device import Device
from zerolite.layout.manifest import DTYPES, Manifest, TensorEntry
from zerolite.quant.cpu_kernels import (
    Int4Matmul,
    Int8Matmul,
    bf16_matmul_in_hardware,
    bf16_rows_rounded,
    int4_dequantize_transposed,
    int4_in_tiles,
)
from zerolite.quant.gpu_int4 import Int4Kernel, fits, inner_k_tiles, int4_kernel, paired_columns
from zerolite.quant.int4_packing import Int4Packing, unpack_int4
from zerolite.quant.quantize import (
    SCALE_SUFFIX,
    SCALE_ZERO_SUFFIX,
    WeightScheme,
    linear_shape,
    whole_groups,
)

# From these many rows on, dequantise-then-matmul beats the CPU kernels: their cost grows with
# the rows, while dequantising costs the same for one row as for many. Where the two cross depends
# on the CPU; these were set from those measured (docs/benchmarks-cpu-kernels.md). Where the CPU has
# no bf16 instructions torch's bf16 matmul runs at a sixth of fp32's speed (bf16_matmul_in_hardware):
# there bf16 rows' weights dequantise into fp32 (DEQUANTIZED_DTYPE), and where the kernels round the
# rows to int8 they take every row count (an AVX2 EPYC, 512 rows of 2048 x 5632, avx2int8: int4 96-133 ms,
# int8 78-84; dequantising into fp32 for fp32's matmul 122).
KERNELS_TAKE_EVERY_ROW = not bf16_matmul_in_hardware() and bf16_rows_rounded()
DEQUANTIZE_ROWS = 1 << 62 if KERNELS_TAKE_EVERY_ROW else 64
INT4_DEQUANTIZE_ROWS = 1 << 62 if KERNELS_TAKE_EVERY_ROW else 64
# The dtype a CPU's matmul of bf16 rows dequantises the weight into.
DEQUANTIZED_DTYPE = torch.bfloat16 if bf16_matmul_in_hardware() else torch.float32
# Where int4 multiplies in AMX's tiles (cpu_kernels.int4_in_tiles) the kernel's cost grows with
# the rows far more slowly: it beats dequantise-then-matmul up to this many (level here, 1.2x
# slower at 2048 rows).
TILES_INT4_DEQUANTIZE_ROWS = 1024
# On a GPU, below these many rows int4 multiplies through the fused kernel: it reads the packed
# nibbles once, but its time grows with the rows, while dequantising with Scratch reads and writes
# about 11 bytes a weight whatever their number, then runs bf16's matmul (the H100's figures:
# docs/design-figures.md).
FUSED_INT4_ROWS = 64


class Scratch:
    """The buffer a GPU's quantized layers dequantise into, one after another on the compute
    stream (each layer's matmul has read it before the next layer writes it): the largest weight
    once in the activations' dtype, taken once and kept, where a fresh allocation per call would
    churn the allocator. Counted in dequantize_workspace. A CPU's int4 layers dequantise a
    prefill's weights into one too (a fresh one per call took a page fault every 4 KiB), counted
    in cpu_dequantize_workspace."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = None  # the old one goes before the larger one is taken
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer[:nbytes].view(dtype).view(shape)


class QuantizedLinear(nn.Module):
    """What the int8 and int4 modules share: the bias, and rows in and out."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dequantize: bool,
                 scratch: Scratch | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dequantize = dequantize
        self.scratch = scratch  # where a GPU, or a CPU for a prefill, dequantises the weight (None: a fresh tensor)
        self.bias = bias
        self.dense: torch.Tensor | None = None  # the weight dequantised once, for a layer resident on a GPU
        # a CPU's kernel call for the weight bound now (cpu_kernels.Int4Matmul, Int8Matmul), made at its
        # first call; it holds the bound views, as the block's binding does (zerolite.runtime.binding)
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this a hundred times at batch 1, each a few microseconds of weights:
        # written to add little to them (a buffer is read from _buffers, not through nn.Module's
        # attribute lookup, and nothing is copied, converted or reshaped that is already as needed).
        # The kernels read rows as they lie (mamba's projections are given a transposed input).
        if not x.is_contiguous():
            x = x.contiguous()
        if self.dense is not None:
            y = F.linear(x, self.dense)
        elif self.dequantize:
            y = self.multiply(x.view(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        else:
            y = self.multiply_on_cpu(x)
        if self.bias is not None:
            y = y + self.bias
        return y

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        """A GPU's product of rows [rows, in]."""
        raise NotImplementedError

    def multiply_on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """A CPU's product of x [..., in] (contiguous), in x's dtype."""
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight in dtype."""
        raise NotImplementedError

    def unbound(self) -> None:
        """The block's tensors were taken out (zerolite.runtime.binding): what was made from them goes."""

    def _buffer(self, shape: tuple[int, int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer on like's device, in like's dtype unless another is given."""
        dtype = dtype or like.dtype
        if self.scratch is None:
            return torch.empty(shape, dtype=dtype, device=like.device)
        return self.scratch.take(shape, dtype, like.device)


class Int8Linear(QuantizedLinear):
    def __init__(self, out_features: int, in_features: int, scale_dtype: torch.dtype, bias: torch.Tensor | None,
                 dequantize: bool, scratch: Scratch | None = None):
        super().__init__(out_features, in_features, bias, dequantize, scratch)
        # Meta placeholders: the executor binds the stored int8 weight and its scales over them.
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.int8, device="meta"))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=scale_dtype, device="meta"))

    def multiply_on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= DEQUANTIZE_ROWS * self.in_features:
            dtype = DEQUANTIZED_DTYPE if x.dtype == torch.bfloat16 else x.dtype
            return F.linear(x.to(dtype), self.dequantized(dtype)).to(x.dtype)
        kernel, weight = self.kernel, self._buffers["weight"]
        if kernel is None or kernel.q is not weight:
            kernel = self.kernel = Int8Matmul(weight, self._buffers["weight" + SCALE_SUFFIX])
        y = kernel(x)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        """A GPU's path: the int8 weight widened once into the scratch buffer (its integers are
        exact in every float dtype) and multiplied, each output column then scaled by its row's
        scale: one pass over the weight besides the matmul's, where scaling the weight takes two.
        In fp16 the unscaled sums (up to 127 times the weights') could overflow, so there the
        widened weight is scaled in place."""
        scale = getattr(self, "weight" + SCALE_SUFFIX).to(rows.dtype)
        weight = self._buffer(tuple(self.weight.shape), rows)
        weight.copy_(self.weight)
        if rows.dtype == torch.float16:
            return F.linear(rows, weight.mul_(scale[:, None]))
        return F.linear(rows, weight).mul_(scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * getattr(self, "weight" + SCALE_SUFFIX).to(dtype)[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(QuantizedLinear):
    def __init__(self, out_features: int, in_features: int, scheme: WeightScheme, scale_dtype: torch.dtype,
                 bias: torch.Tensor | None, dequantize: bool, scratch: Scratch | None = None,
                 kernel: Int4Kernel | None = None):
        """kernel: a GPU's fused int4 kernel (zerolite.quant.gpu_int4), where it has one."""
        super().__init__(out_features, in_features, bias, dequantize, scratch)
        self.group_size = scheme.group_size
        self.packing = scheme.packing
        self.stored_in = whole_groups(in_features, self.group_size)  # a partial last group is stored padded
        self.register_buffer("weight", torch.empty((out_features, self.stored_in // 2), dtype=torch.uint8,
                                                   device="meta"))
        self.register_buffer("weight" + SCALE_ZERO_SUFFIX, torch.empty(
            (self.stored_in // self.group_size, out_features, 2), dtype=scale_dtype, device="meta"))
        self.gpu_kernel = kernel if kernel is not None and fits(out_features, self.stored_in, self.group_size) else None
        self._fused: tuple[torch.Tensor, torch.Tensor] | None = None  # (the weight bound, the kernel's packing of it)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        scale_zero = self._buffers["weight" + SCALE_ZERO_SUFFIX]
        if self.gpu_kernel is not None and rows.dtype == torch.bfloat16 and rows.shape[0] < FUSED_INT4_ROWS:
            return self.gpu_kernel.mm(self.padded(rows), self.fused_weight(), self.group_size,
                                      scale_zero.to(rows.dtype))
        weight = self._buffer((self.out_features, self.stored_in), rows)
        dequantize_int4_into(weight, self.weight, scale_zero, self.group_size, self.packing)
        return F.linear(self.padded(rows), weight)

    def multiply_on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        count = x.numel() // self.in_features
        if count >= INT4_DEQUANTIZE_ROWS and (count >= TILES_INT4_DEQUANTIZE_ROWS or not int4_in_tiles(
                x.dtype, self.out_features, self.group_size, self.packing)):
            # The transpose, as the kernel writes it in one pass; torch's matmul takes either.
            dtype = DEQUANTIZED_DTYPE if x.dtype == torch.bfloat16 else torch.float32
            transposed = self._buffer((self.in_features, self.out_features), x, dtype)
            int4_dequantize_transposed(transposed, self.weight, self._buffers["weight" + SCALE_ZERO_SUFFIX],
                                       self.group_size, self.packing)
            return torch.matmul(x.to(dtype), transposed).to(x.dtype)
        kernel, weight = self.kernel, self._buffers["weight"]
        if kernel is None or kernel.packed is not weight:
            kernel = self.kernel = Int4Matmul(weight, self._buffers["weight" + SCALE_ZERO_SUFFIX], self.out_features,
                                              self.in_features, self.group_size, self.packing)
        y = kernel(x)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """rows with zeros against the weight's padding columns: whatever those hold, they add nothing."""
        return F.pad(rows, (0, self.stored_in - self.in_features)) if self.stored_in > self.in_features else rows

    def fused_weight(self) -> torch.Tensor:
        """The fused kernel's packing of the weight bound now, made at its first call (on the
        device, from the nibbles as the slot holds them) and kept until the block is unbound."""
        if self._fused is None or self._fused[0] is not self.weight:
            q = unpack_int4(self.weight, self.out_features, self.stored_in, self.packing)
            self._fused = None  # the last block's packing goes before this one's is made
            self._fused = (self.weight, self.gpu_kernel.pack(paired_columns(q), inner_k_tiles(self.stored_in)))
        return self._fused[1]

    def unbound(self) -> None:
        if self._fused is not None:  # (nn.Module's assignment costs microseconds, at every layer's unbinding)
            self._fused = None

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


def dequantize_int4_into(out: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                         packing: Int4Packing) -> None:
    """dequantize_int4 in fewer passes, into out ([out, groups * group_size], the activations'
    dtype): each nibble widened straight into its place in out, then q * scale + (zero - 8 *
    scale) in one pass over it. About 11 bytes of memory traffic a weight with the matmul's read
    (dequantize_int4's temporaries: over 20)."""
    rows, cols = out.shape
    flat = packed.reshape(-1)
    full = rows // packing.block_rows * packing.block_rows
    if full:
        blocks = flat[: full * cols // 2].reshape(full // packing.block_rows, cols, packing.block_rows // 2)
        widen_nibbles(blocks, out[:full].view(full // packing.block_rows, packing.block_rows, cols), packing.interleave)
    if rows > full:
        tail = flat[full * cols // 2:].reshape(1, cols, (rows - full) // 2)
        widen_nibbles(tail, out[full:].view(1, rows - full, cols), "pairs")
    scale, zero = scale_zero.transpose(0, 1).float().unbind(-1)  # [out, groups] each
    grouped = out.view(rows, cols // group_size, group_size)
    torch.addcmul((zero - 8 * scale).to(out.dtype)[..., None], grouped, scale.to(out.dtype)[..., None], out=grouped)


def widen_nibbles(packed: torch.Tensor, out: torch.Tensor, interleave: str) -> None:
    """packed: uint8 [blocks, cols, block / 2], a block's rows two to a byte; out: [blocks, block,
    cols], each nibble's value written to its row (zerolite.quant.int4_packing's order)."""
    blocks, block, cols = out.shape
    low, high = (packed & 15).transpose(1, 2), (packed >> 4).transpose(1, 2)
    if interleave == "halves":
        out[:, : block // 2].copy_(low)
        out[:, block // 2:].copy_(high)
    else:
        pairs = out.view(blocks, block // 2, 2, cols)
        pairs[:, :, 0].copy_(low)
        pairs[:, :, 1].copy_(high)


def install(model: nn.Module, manifest: Manifest, device: Device) -> None:
    """Replaces every module whose weight the layout stores quantized (it has a companion tensor)."""
    if manifest.quantization is None:
        return
    scheme = WeightScheme.from_manifest(manifest.quantization)
    scale_dtype = DTYPES[manifest.dtype]
    scratch = Scratch()
    kernel = int4_kernel(device) if scheme.name == "int4" and device.separate_memory else None
    for block in manifest.blocks:
        for weight in quantized_weights(manifest, block.name):
            parent_path, _, leaf = weight.name.removesuffix(".weight").rpartition(".")
            parent = model.get_submodule(parent_path)
            original = getattr(parent, leaf)
            bias = getattr(original, "bias", None)
            shape = linear_shape(original)
            if scheme.name == "int8":
                module = Int8Linear(shape.out_features, shape.in_features, scale_dtype, bias, device.separate_memory,
                                    scratch)
            else:
                module = Int4Linear(shape.out_features, shape.in_features, scheme, scale_dtype, bias,
                                    device.separate_memory, scratch, kernel)
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
    """How many weights a quantized tensor holds."""
    return memory_model.quantized_weight_count(manifest.quantization["weights"], tensor.nbytes)


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
    weights = sum(weight_count(manifest, tensor) for tensor in quantized_weights(manifest, name))
    return memory_model.dense_weight_bytes(weights, DTYPES[manifest.dtype])


def dequantize_workspace(manifest: Manifest) -> int:
    """The most device memory the layout's streamed quantized layers take for their matmuls on a
    GPU (zerolite.memory_model.dequantize_workspace), from its largest weight and largest layer."""
    if manifest.quantization is None:
        return 0
    blocks = [quantized_weights(manifest, block.name) for block in manifest.blocks]
    packed = max((sum(tensor.nbytes for tensor in tensors) for tensors in blocks), default=0)
    return memory_model.dequantize_workspace(manifest.quantization["weights"], largest_weight(manifest),
                                             DTYPES[manifest.dtype], packed)


def cpu_dequantize_workspace(manifest: Manifest) -> int:
    """The most host memory a CPU's quantized layers take for a prefill's matmuls
    (zerolite.memory_model.cpu_dequantize_workspace), from the layout's largest weight, in the
    dtype its weights dequantise into there (a bf16 layout's: DEQUANTIZED_DTYPE)."""
    if manifest.quantization is None:
        return 0
    dtype = DTYPES[manifest.dtype]
    return memory_model.cpu_dequantize_workspace(manifest.quantization["weights"], largest_weight(manifest),
                                                 DEQUANTIZED_DTYPE if dtype == torch.bfloat16 else dtype)


def largest_weight(manifest: Manifest) -> int:
    """How many weights the layout's largest quantized tensor holds."""
    return max((weight_count(manifest, tensor) for block in manifest.blocks
                for tensor in quantized_weights(manifest, block.name)), default=0)

