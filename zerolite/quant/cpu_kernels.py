"""zerolite's own CPU kernels for int4, int8 and bf16 weights (csrc/int4_matmul.cpp, csrc/int8_matmul.cpp,
csrc/bf16_matmul.cpp): they read the weights as a layout stores them, take fp32 rows and give fp32
rows (bf16 ones where the path rounds them to int8 anyway, and for bf16 weights).

    y = int4_matmul(x, packed, scale_zero, out_features, group_size, packing)   # x: [rows, in] fp32 or bf16
    y = int8_matmul(x, q, scale)
    y = bf16_matmul(x, weight)                                                    # x, weight, y: bf16
    dequantize_int4_transposed(out, packed, scale_zero, group_size, packing)      # out: [in, out] bf16 or fp32
    kernel = Int4Matmul(packed, scale_zero, out_features, in_features, group_size, packing)
    y = kernel(x)      # x: [..., in]; the weight checked once, for many calls (Int8Matmul, Bf16Matmul alike)

Each kernel has a path per instruction set (AVX-512, AVX2 with FMA, plain C++), chosen at run time
from what the CPU offers, or forced with
ZEROLITE_CPU_KERNEL=amx|avx512bf16|avx512vnni|avx512|avx2int8|avx2|scalar (tests run every path the
CPU has; each path includes those below it, but for avx2int8). avx512, avx2 and scalar compute in
fp32 exactly what the weights dequantise to. Where the CPU has AVX-512 VNNI and VBMI, int4 and int8
rows that are not fp32 (bf16, fp16: already rounded) take avx512vnni, which rounds them to int8 per
32 columns, as llama.cpp's Q4_0 and Q8_0 do, and multiplies bytes: several times faster, at about
0.5% of relative error in a product (docs/benchmarks-cpu-kernels.md gives its perplexity); where it
has AVX2 only, avx2int8 does the same with AVX2's byte products; fp32 rows keep the exact path.
bf16 weights (bf16_matmul, bf16 rows) take AVX-512 BF16's dot products where the CPU has them
(avx512bf16), fp32 sums either way. Where the CPU has
AMX (amx_int8, amx_bf16) and Linux grants the process its tile state, int4 multiplies in AMX's
bf16 tiles from 8 rows of x on (amx: its weights dequantised to bf16 as it goes, x rounded to
bf16, fp32 sums; 1.6x avx512vnni's speed at 16 rows, 2.8x at 64, and faster than dequantising
for torch's matmul up to about a thousand rows: int4_in_tiles; int8 and bf16 run there as at
avx512bf16). They run on torch's thread count (or the count set_kernel_threads gave), on a pool
of the extension's own whose idle threads sleep, and release the GIL. Tensors go in as
addresses: the checks here are all they get.
"""

from __future__ import annotations

import functools
import os

import torch

from zerolite import _engine
from zerolite.errors import ZeroliteError
from zerolite.quant.int4_packing import Int4Packing

PATH_VARIABLE = "ZEROLITE_CPU_KERNEL"
# int4 and int8 there: x rounded to int8 per 32 columns, as llama.cpp does (avx2int8 on AVX2's byte
# products; the others include avx512vnni)
ROUNDS_ACTIVATIONS = ("avx2int8", "avx512vnni", "avx512bf16", "amx")


def supported_paths() -> list[str]:
    """The kernel paths this CPU runs, best last."""
    return list(_engine.cpu_kernel_paths())


@functools.cache
def bf16_matmul_in_hardware() -> bool:
    """Whether torch's bf16 matmul runs on this CPU's own bf16 instructions (AVX-512 BF16 or AMX,
    through oneDNN). Without them it widens as it goes, at a sixth of fp32's speed or less (an AVX2
    EPYC, 2 threads, 512 rows of 2048 into 5632: bf16 575 ms, fp32 96 ms; zerolite's bf16 kernel
    139 ms: docs/benchmarks-cpu-kernels.md), and the layers' many-row products take another path."""
    return any(path in supported_paths() for path in ("avx512bf16", "amx"))


def bf16_rows_rounded() -> bool:
    """Whether bf16 rows take, by default, a path that rounds them to int8 (avx2int8, avx512vnni
    and above): the kernels' fast integer paths."""
    return _best(False) in ROUNDS_ACTIVATIONS


@functools.cache
def _path_number(name: str) -> int:
    try:
        return _engine.cpu_kernel_path(name)
    except ValueError:
        raise ZeroliteError(f"{PATH_VARIABLE}={name}: this CPU runs the kernel paths "
                            f"{', '.join(supported_paths())}") from None


@functools.cache
def _best(exact: bool) -> str:
    return [path for path in supported_paths() if not (exact and path in ROUNDS_ACTIVATIONS)][-1]


def kernel_path(exact: bool = True) -> int:
    """The path the kernels take: ZEROLITE_CPU_KERNEL's, else the best this CPU runs, less those
    that round the activations where exact."""
    return _path_number(os.environ.get(PATH_VARIABLE) or _best(exact))


@functools.cache
def _rounding(path: int) -> bool:
    return path in {_path_number(name) for name in ROUNDS_ACTIVATIONS if name in supported_paths()}


# The threads the kernels run on: torch's, unless a forward of few rows gave torch's own ops one
# thread and the kernels the threads torch had (zerolite.runtime.decode_threads).
_kernel_threads: int | None = None


def set_kernel_threads(threads: int | None) -> None:
    """The kernels run on `threads` threads from here on; None: on torch's thread count."""
    global _kernel_threads
    _kernel_threads = threads


def kernel_threads() -> int:
    return _kernel_threads or torch.get_num_threads()


# A decode step makes a hundred kernel calls, each a few microseconds of weights at batch 1: a
# layer's module keeps an Int4Matmul, Int8Matmul or Bf16Matmul made for the weight bound to it,
# which checks the weight and works out the kernel's arguments once, so that a call costs a view,
# an output tensor and the extension's entry (the checks and arguments, made per call, took 20 us).
_CPU = torch.device("cpu")


def _rows_paths() -> tuple[int, int, bool]:
    """The paths fp32 rows and other rows take (ZEROLITE_CPU_KERNEL's, read as a weight is made
    ready), and whether the latter takes bf16 rows as they are: it rounds them to int8 anyway."""
    other = kernel_path(exact=False)
    return kernel_path(exact=True), other, _rounding(other)


class _QuantizedMatmul:
    """What the int4 and int8 calls share: x [..., in] (contiguous, on the CPU) as the kernel reads
    it: bf16 rows as they are where the path rounds them anyway (no conversion either side of the
    call), fp32 rows otherwise; y [..., out] in that dtype."""

    __slots__ = ("in_features", "out_features", "_exact_path", "_path", "_takes_bf16")

    def __init__(self, out_features: int, in_features: int):
        self.in_features, self.out_features = in_features, out_features
        self._exact_path, self._path, self._takes_bf16 = _rows_paths()

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(x as the kernel reads it, the path, y to write)."""
        shape = x.shape
        if x.device != _CPU or not shape or shape[-1] != self.in_features:
            raise ValueError(f"rows must be a CPU tensor [rows, {self.in_features}], not {tuple(shape)} on {x.device}")
        dtype = x.dtype
        if dtype == torch.bfloat16 and self._takes_bf16:
            path = self._path
        else:
            path = self._exact_path if dtype == torch.float32 else self._path
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        return x, path, torch.empty((*shape[:-1], self.out_features), dtype=x.dtype)


class Int4Matmul(_QuantizedMatmul):
    """x @ an int4 weight's transpose (int4_matmul), the weight checked once: for a module whose
    weight stays bound over many calls. packed is the tensor it was made for."""

    __slots__ = ("packed", "_scale_zero", "_weight")

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int, in_features: int,
                 group_size: int, packing: Int4Packing):
        if not _int4_fits(packed, scale_zero, out_features, in_features, group_size):
            raise ValueError(f"an int4 weight of {out_features} x {in_features} in groups of {group_size} does not "
                             f"match packed {tuple(packed.shape)} and scale_zero {tuple(scale_zero.shape)}")
        super().__init__(out_features, in_features)
        self.packed = packed
        self._scale_zero = _scales(scale_zero)  # kept: the kernel reads it by address
        self._weight = (packed.data_ptr(), out_features, in_features, scale_zero.shape[0] * group_size, group_size,
                        packing.block_rows, packing.interleave == "halves", self._scale_zero.data_ptr(),
                        self._scale_zero.dtype == torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, path, y = self._rows(x)
        _engine.int4_matmul(x.data_ptr(), x.numel() // self.in_features, self.in_features, y.data_ptr(),
                            self.out_features, *self._weight, path, kernel_threads(), x.dtype == torch.bfloat16)
        return y


class Int8Matmul(_QuantizedMatmul):
    """x @ (q * scale[:, None]) transposed (int8_matmul), the weight checked once. q is the tensor
    it was made for."""

    __slots__ = ("q", "_scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        out_features, in_features = q.shape
        if q.dtype != torch.int8 or not q.is_contiguous() or tuple(scale.shape) != (out_features,):
            raise ValueError(f"an int8 weight must be int8 [out, in] with a scale per row: {tuple(q.shape)} "
                             f"{q.dtype}, scale {tuple(scale.shape)}")
        super().__init__(out_features, in_features)
        self.q = q
        self._scale = scale.float().contiguous()  # kept: the kernel reads it by address

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, path, y = self._rows(x)
        _engine.int8_matmul(x.data_ptr(), x.numel() // self.in_features, self.in_features, y.data_ptr(),
                            self.out_features, self.q.data_ptr(), self.out_features, self.in_features,
                            self._scale.data_ptr(), path, kernel_threads(), x.dtype == torch.bfloat16)
        return y


class Bf16Matmul:
    """x @ a bf16 weight's transpose (bf16_matmul), the weight checked once. x: bf16 [..., in],
    contiguous, on the CPU (what Bf16KernelLinear gives it); weight is the tensor it was made for."""

    __slots__ = ("weight", "_path")

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous() or weight.device != _CPU:
            raise ValueError(f"a bf16 weight must be a contiguous CPU bf16 [out, in]: {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        self.weight = weight
        self._path = kernel_path(exact=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.weight.shape
        y = torch.empty((*x.shape[:-1], out_features), dtype=torch.bfloat16)
        _engine.bf16_matmul(x.data_ptr(), x.numel() // in_features, in_features, y.data_ptr(), out_features,
                            self.weight.data_ptr(), out_features, in_features, self._path, kernel_threads())
        return y


def _int4_fits(packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int, in_features: int,
               group_size: int) -> bool:
    """Whether an int4 weight of out_features x in_features in groups of group_size is what packed
    ([out, stored in / 2], contiguous) and scale_zero ([groups, out, 2]) hold; the last group may be partial."""
    groups = scale_zero.shape[0]
    stored_in = groups * group_size
    return (packed.dtype == torch.uint8 and packed.shape == (out_features, stored_in // 2)
            and packed.is_contiguous() and scale_zero.shape == (groups, out_features, 2)
            and stored_in - group_size < in_features <= stored_in)


def _scales(scale_zero: torch.Tensor) -> torch.Tensor:
    """Scales and zeros as the kernels read them: bf16 as stored, anything else as fp32, contiguous."""
    if scale_zero.dtype != torch.bfloat16:
        scale_zero = scale_zero.float()
    return scale_zero if scale_zero.is_contiguous() else scale_zero.contiguous()


def _two_dimensional(x: torch.Tensor, in_features: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"rows must be a CPU tensor [rows, {in_features}], not {tuple(x.shape)} on {x.device}")


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int,
                group_size: int, packing: Int4Packing) -> torch.Tensor:
    """x [rows, in] @ the int4 weight's transpose: in bf16 where x is bf16 and the path rounds it to
    int8 first (avx512vnni and above: the default for bf16 rows where the CPU runs them), in fp32
    otherwise. packed: uint8 [out, stored in / 2] in
    packing's order; scale_zero: [groups, out, 2], weight = (q - 8) * scale + zero. x may be
    narrower than the stored width (a partial last group): the padding is skipped."""
    matmul = Int4Matmul(packed, scale_zero, out_features, x.shape[-1], group_size, packing)
    _two_dimensional(x, x.shape[-1])
    return matmul(x)


@functools.cache
def _amx_number() -> int | None:
    return _path_number("amx") if "amx" in supported_paths() else None


def int4_in_tiles(x_dtype: torch.dtype, out_features: int, group_size: int, packing: Int4Packing) -> bool:
    """Whether int4_matmul multiplies rows of x_dtype by such a weight in AMX's tiles (from 8 rows
    on): the amx path, rows not fp32, whole 64-row "halves" blocks in groups of a multiple of 32."""
    return (x_dtype != torch.float32 and kernel_path(exact=False) == _amx_number()
            and packing == Int4Packing(64, "halves") and out_features % 64 == 0 and group_size % 32 == 0)


def int4_dequantize_transposed(out: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                               packing: Int4Packing) -> torch.Tensor:
    """Writes the int4 weight's transpose into out ([in, out], bf16 or fp32, contiguous), in one
    pass over it: for a prefill, whose many rows then run as one matmul. Returns out."""
    in_features, out_features = out.shape
    stored_in = scale_zero.shape[0] * group_size
    if (out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous()
            or not _int4_fits(packed, scale_zero, out_features, in_features, group_size)):
        raise ValueError(f"an int4 weight of {out_features} x {in_features} in groups of {group_size} does not match "
                         f"packed {tuple(packed.shape)}, scale_zero {tuple(scale_zero.shape)} "
                         f"and out {tuple(out.shape)} {out.dtype}")
    scale_zero = _scales(scale_zero)
    _engine.int4_dequantize_transposed(out.data_ptr(), out.dtype == torch.bfloat16, packed.data_ptr(), out_features,
                                       in_features, stored_in, group_size, packing.block_rows,
                                       packing.interleave == "halves", scale_zero.data_ptr(),
                                       scale_zero.dtype == torch.bfloat16, kernel_path(), kernel_threads())
    return out


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ (q * scale[:, None]) transposed, in int4_matmul's dtype (x rounded to int8
    per 32 columns first where it is not fp32 and the CPU runs avx512vnni). q: int8 [out, in]."""
    matmul = Int8Matmul(q, scale)
    _two_dimensional(x, matmul.in_features)
    return matmul(x)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight.t(), all bf16 (fp32 sums, rounded to bf16 as torch's matmul rounds).
    weight: bf16 [out, in], contiguous. For a few rows: each weight row is read once for every
    4 rows of x, where a matmul of many rows (AMX, oneDNN's blocking) is torch's to run."""
    matmul = Bf16Matmul(weight)
    in_features = weight.shape[1]
    if x.device != _CPU or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"rows must be a CPU tensor [rows, {in_features}], not {tuple(x.shape)} on {x.device}")
    return matmul(x.to(torch.bfloat16).contiguous())
