"""zerolite's CPU kernels for int4, int8 and bf16 weights (zerolite.quant.cpu_kernels): every path this
CPU runs, forced with ZEROLITE_CPU_KERNEL, against the fp32 matmul of the same weights
dequantised, on shapes that reach each tail: a last block of fewer output rows (16, 48), a
partial last group, widths that are no multiple of a vector, and row counts off the tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerolite.quant.linear
from zerolite.errors import ZeroliteError
from zerolite.quant import bf16_linear, cpu_kernels
from zerolite.quant.bf16_linear import Bf16KernelLinear, use_bf16_kernel
from zerolite.quant.int4_packing import CANDIDATES, Int4Packing, pack_int4, unpack_int4
from zerolite.quant.linear import Int4Linear, Int8Linear, dequantize_int4
from zerolite.quant.quantize import LinearShape, WeightScheme, linear_shape, quantize_int4, quantize_int8

PATHS = cpu_kernels.supported_paths()
# (out, in, group): out a multiple of 16 (the packer's), its last block of 16, 32 or 48 rows
# after whole blocks of 64; in with a partial last group, or odd.
INT4_SHAPES = [(64, 64, 32), (80, 100, 32), (48, 70, 64), (112, 33, 32), (192, 576, 128), (16, 129, 64)]
# 45: a task of 32 rows, then one of 13 (avx512vnni's runs of 8 at one row of x, then of 4, then one)
INT8_SHAPES = [(64, 64), (7, 100), (45, 17), (5, 1), (192, 576), (130, 1537)]
BF16_SHAPES = [(64, 64), (7, 100), (33, 17), (5, 1), (130, 1537)]  # out off the runs of 4, in off 8, 16 and 32
ROW_COUNTS = [1, 3, 4, 6, 9]
# amx's int4 tiles take 8 rows and more (csrc/int4_matmul.cpp's AMX_MIN_ROWS): 16 rows to a tile,
# fewer than 16 in one tile, the last of several partial, and the sums of 256 rows kept at once;
# the weights as integers up to 8 rows in groups of 32, 16 in groups of 64 and more (12: a partial tile)
AMX_ROW_COUNTS = [8, 12, 15, 16, 17, 40, 64, 65, 257]
RELATIVE = 2e-6  # fp32 sums in another order: a few ulps of the largest output
ROUNDED_RELATIVE = 1e-2  # x rounded to int8 per 32 columns: about 0.5% measured


# avx512bf16 adds bf16's dot products only: int4 and int8 run there as at avx512vnni (as the last
# test here checks), so their many shapes are not run at both; amx adds int4's matmul only.
SAME_AS_BELOW = "avx512bf16"
INT4_ONLY = "amx"
QUANTIZED_PATHS = [p for p in PATHS if p not in (SAME_AS_BELOW, INT4_ONLY)]
INT4_PATHS = [p for p in PATHS if p != SAME_AS_BELOW]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, request.param)
    return request.param


@pytest.fixture(params=QUANTIZED_PATHS)
def quantized_path(request, monkeypatch):
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, request.param)
    return request.param


@pytest.fixture(params=INT4_PATHS)
def int4_path(request, monkeypatch):
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, request.param)
    return request.param


def assert_close(got: torch.Tensor, exact: torch.Tensor, terms: int) -> None:
    tolerance = RELATIVE * terms ** 0.5 * exact.abs().max()
    assert (got - exact).abs().max() <= tolerance, (got - exact).abs().max() / exact.abs().max()


def assert_rounded_close(got: torch.Tensor, exact: torch.Tensor) -> None:
    """x rounded to int8 per 32 columns (and the outputs to bf16, where they are): a relative error."""
    assert (got - exact).norm() <= ROUNDED_RELATIVE * exact.norm(), (got - exact).norm() / exact.norm()


@pytest.mark.parametrize("packing", CANDIDATES, ids=lambda p: f"{p.block_rows}-{p.interleave}")
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_int4_computes_what_its_weights_dequantise_to(int4_path, packing, shape, scale_dtype):
    """avx512vnni and amx round x to int8 per 32 columns: held to a relative error, not to fp32's."""
    out, inp, group = shape
    generator = torch.Generator().manual_seed(out * inp)
    q, scale_zero = quantize_int4(torch.randn(out, inp, generator=generator).to(scale_dtype), group)
    packed = pack_int4(q, packing)
    weight = dequantize_int4(packed, scale_zero.float(), group, packing, torch.float32)[:, :inp]
    for rows in ROW_COUNTS + (AMX_ROW_COUNTS if int4_path == INT4_ONLY else []):
        x = torch.randn(rows, inp, generator=generator)
        got, exact = cpu_kernels.int4_matmul(x, packed, scale_zero, out, group, packing), x @ weight.t()
        if int4_path in cpu_kernels.ROUNDS_ACTIVATIONS:
            assert_rounded_close(got, exact)
            # bf16 rows, as the path takes them by default: read and written as bf16 (by the 64-row
            # "halves" blocks' tile) or through fp32 copies (any other block)
            got = cpu_kernels.int4_matmul(x.bfloat16(), packed, scale_zero, out, group, packing)
            assert got.dtype == torch.bfloat16
            assert_rounded_close(got.float(), x.bfloat16().float() @ weight.t())
        else:
            assert_close(got, exact, inp)


def test_only_rows_already_rounded_take_the_path_that_rounds_them(monkeypatch):
    """By default fp32 rows take the best exact path, bf16 rows the best path."""
    monkeypatch.delenv(cpu_kernels.PATH_VARIABLE, raising=False)
    exact = [path for path in PATHS if path not in cpu_kernels.ROUNDS_ACTIVATIONS][-1]
    assert cpu_kernels.kernel_path(exact=True) == cpu_kernels._path_number(exact)
    assert cpu_kernels.kernel_path(exact=False) == cpu_kernels._path_number(PATHS[-1])


@pytest.mark.parametrize("packing", CANDIDATES, ids=lambda p: f"{p.block_rows}-{p.interleave}")
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_dequantises_into_its_transpose(quantized_path, packing, shape, dtype):
    """The prefill's path: every weight as dequantize_int4 makes it, in fp32 or rounded to bf16
    (to nearest even, as torch rounds), the stored padding columns left out."""
    out, inp, group = shape
    generator = torch.Generator().manual_seed(out + inp)
    q, scale_zero = quantize_int4(torch.randn(out, inp, generator=generator).bfloat16(), group)
    packed = pack_int4(q, packing)
    expected = dequantize_int4(packed, scale_zero.float(), group, packing, torch.float32)[:, :inp].t()
    got = cpu_kernels.int4_dequantize_transposed(torch.full((inp, out), float("nan"), dtype=dtype), packed,
                                                 scale_zero, group, packing)
    assert torch.allclose(got.float(), expected.to(dtype).float(), rtol=0, atol=1e-6 * expected.abs().max())


@pytest.mark.parametrize("shape", INT8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_computes_what_its_weights_dequantise_to(quantized_path, shape):
    out, inp = shape
    generator = torch.Generator().manual_seed(out * inp)
    q, scale = quantize_int8(torch.randn(out, inp, generator=generator).bfloat16())
    weight = q.float() * scale.float()[:, None]
    for rows in ROW_COUNTS:
        x = torch.randn(rows, inp, generator=generator)
        if quantized_path in cpu_kernels.ROUNDS_ACTIVATIONS:  # rounded per 32 columns; bf16 rows kept bf16
            assert_rounded_close(cpu_kernels.int8_matmul(x, q, scale), x @ weight.t())
            got = cpu_kernels.int8_matmul(x.bfloat16(), q, scale)
            assert got.dtype == torch.bfloat16
            assert_rounded_close(got.float(), x.bfloat16().float() @ weight.t())
        else:
            assert_close(cpu_kernels.int8_matmul(x, q, scale), x @ weight.t(), inp)


def rounded_rows(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x rounded as the paths that round activations round it, in the same fp32 operations (so to
    the same integers): per 32 columns, step = largest |x| / 127, q = x / step rounded half away
    from zero; returned as q * step in fp64, [rows, padded]."""
    blocks = F.pad(x.float(), (0, padded - x.shape[1])).view(x.shape[0], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, torch.ones_like(step).div(step), torch.zeros_like(step))
    scaled = blocks * inverse
    q = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
    return (q.double() * step.double()).view(x.shape[0], padded)


def assert_as_rounded(got: torch.Tensor, expected: torch.Tensor, terms: int) -> None:
    """fp32 rows out: fp32's sums; bf16 rows out: each within one bf16 rounding of the expected."""
    if got.dtype == torch.float32:
        assert_close(got.double(), expected, terms)
    else:
        slack = 2 ** -8 * expected.abs() + RELATIVE * terms ** 0.5 * expected.abs().max()
        assert ((got.double() - expected).abs() <= slack).all(), ((got.double() - expected).abs() - slack).max()


# rows of unlike sizes: a block that read past its row's end would take its step from the next row's
ROW_SIZES = torch.tensor([1.0, 100.0, 0.01, 10.0, 1.0, 1000.0, 0.1, 1.0, 3.0])[:, None]
ROUNDING_PATHS = [p for p in cpu_kernels.ROUNDS_ACTIVATIONS if p in QUANTIZED_PATHS]


@pytest.mark.parametrize("rounding_path", ROUNDING_PATHS)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [64, 32])
def test_int4_rounds_rows_as_llama_cpp_does(rounding_path, shape, dtype, block_rows, monkeypatch):
    """The "halves" blocks the path tiles (64 rows: AVX-512's packing; avx2int8 also 32: AVX2's)
    multiply x rounded per 32 columns (its exact sums weigh the zeros): each output as those
    integers give it, to fp32's sums; other blocks exact."""
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, rounding_path)
    out, inp, group = shape
    packing = Int4Packing(block_rows, "halves")
    generator = torch.Generator().manual_seed(out + inp)
    q, scale_zero = quantize_int4(torch.randn(out, inp, generator=generator).bfloat16(), group)
    stored_in = q.shape[1]
    packed = pack_int4(q, packing)
    scale, zero = (part.double().t().repeat_interleave(group, 1) for part in scale_zero.unbind(-1))  # [out, stored]
    for rows in ROW_COUNTS:
        x = (torch.randn(rows, inp, generator=generator) * ROW_SIZES[:rows]).to(dtype)
        exact = F.pad(x.double(), (0, stored_in - inp))
        expected = rounded_rows(x, stored_in) @ ((q.double() - 8) * scale).t() + exact @ zero.t()
        tiled = block_rows == 64 or rounding_path == "avx2int8"
        whole = out // block_rows * block_rows if tiled else 0  # rows past the whole blocks: exact
        expected[:, whole:] = exact @ ((q[whole:].double() - 8) * scale[whole:] + zero[whole:]).t()
        assert_as_rounded(cpu_kernels.int4_matmul(x, packed, scale_zero, out, group, packing), expected, inp)


def bf16_weights(q: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """[out, stored in] in fp64: each weight as amx dequantises it, q * scale + (zero - 8 * scale)
    in fp32 (its offset rounded, then one rounding of the fused multiply-add), rounded to bf16."""
    scale, zero = (part.double().t().repeat_interleave(group, 1) for part in scale_zero.float().unbind(-1))
    offset = (zero - 8 * scale).float().double()
    return (q.double() * scale + offset).float().bfloat16().double()


@pytest.mark.parametrize("tiles_path", [p for p in PATHS if p == INT4_ONLY])
# and whole blocks only, with a partial step: bf16 rows read as they lie where they are whole steps
@pytest.mark.parametrize("shape", INT4_SHAPES + [(128, 70, 32)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int4_amx_multiplies_bf16_weights_and_rows(tiles_path, shape, dtype, scale_dtype, monkeypatch):
    """From 8 rows on, amx multiplies x rounded to bf16 by the weights: up to 8 rows for each 32
    columns of a group (one tile of 16 at most) as they are, their integers in the tiles and each
    group's sums scaled in fp32; more rows by the weights dequantised to bf16; to fp32's sums
    either way. The blocks past the whole 64-row ones exact. Partial steps of 32 columns read
    zeros past x's end (the padding's nibbles here are random, not zero)."""
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, tiles_path)
    out, inp, group = shape
    packing = Int4Packing(64, "halves")
    generator = torch.Generator().manual_seed(out + inp + 1)
    q, scale_zero = quantize_int4(torch.randn(out, inp, generator=generator).to(scale_dtype), group)
    stored_in = q.shape[1]
    q[:, inp:] = torch.randint(0, 16, (out, stored_in - inp), generator=generator, dtype=torch.uint8)
    packed = pack_int4(q, packing)
    weight = bf16_weights(q, scale_zero, group)
    whole = out // 64 * 64
    exact = dequantize_int4(packed, scale_zero.float(), group, packing, torch.float32).double()
    for rows in AMX_ROW_COUNTS:
        x = (torch.randn(rows, inp, generator=generator) * ROW_SIZES.repeat(29, 1)[:rows]).to(dtype)
        padded = F.pad(x.double(), (0, stored_in - inp))
        integers = rows <= min(16, 8 * group // 32)
        expected = F.pad(x.bfloat16().double(), (0, stored_in - inp)) @ (exact if integers else weight).t()
        expected[:, whole:] = padded @ exact[whole:].t()
        assert_as_rounded(cpu_kernels.int4_matmul(x, packed, scale_zero, out, group, packing), expected, inp)


@pytest.mark.parametrize("rounding_path", ROUNDING_PATHS)
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rounds_rows_as_llama_cpp_does(rounding_path, shape, dtype, monkeypatch):
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, rounding_path)
    out, inp = shape
    generator = torch.Generator().manual_seed(out * inp)
    q, scale = quantize_int8(torch.randn(out, inp, generator=generator).bfloat16())
    padded = (inp + 31) // 32 * 32
    weight = F.pad(q.double(), (0, padded - inp)) * scale.double()[:, None]
    for rows in ROW_COUNTS:
        x = (torch.randn(rows, inp, generator=generator) * ROW_SIZES[:rows]).to(dtype)
        assert_as_rounded(cpu_kernels.int8_matmul(x, q, scale), rounded_rows(x, padded) @ weight.t(), inp)


@pytest.mark.parametrize("shape", BF16_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_computes_its_fp32_sums_rounded_to_bf16(path, shape):
    """Every path sums bf16 products in fp32 (dpbf16's products of bf16 pairs are exact): the
    outputs are the exact sums to within bf16's rounding of them."""
    out, inp = shape
    generator = torch.Generator().manual_seed(out * inp)
    weight = torch.randn(out, inp, generator=generator).bfloat16()
    for rows in ROW_COUNTS:
        x = torch.randn(rows, inp, generator=generator).bfloat16()
        got, exact = cpu_kernels.bf16_matmul(x, weight), x.float() @ weight.float().t()
        assert got.dtype == torch.bfloat16
        tolerance = 2 ** -8 * exact.abs() + RELATIVE * inp ** 0.5 * exact.abs().max()
        assert ((got.float() - exact).abs() <= tolerance).all(), ((got.float() - exact).abs() - tolerance).max()


def test_a_cpu_bf16_linear_takes_the_kernel_for_few_rows_and_torch_for_many(monkeypatch):
    """use_bf16_kernel keeps each Linear's parameters (tied weights stay tied); bf16 calls of
    fewer than KERNEL_ROWS rows take the kernel, others (and fp32 ones) F.linear, with the bias
    (KERNEL_ROWS as a CPU with bf16 instructions has it)."""
    monkeypatch.setattr(bf16_linear, "KERNEL_ROWS", 4)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Linear(24, 40, bias=False)).bfloat16()
    model[1].weight = torch.nn.Parameter(model[0].weight.t().contiguous())
    weights = [module.weight for module in model]
    use_bf16_kernel(model)
    assert all(isinstance(module, Bf16KernelLinear) for module in model)
    assert [module.weight for module in model] == weights
    assert linear_shape(model[0]) == LinearShape(24, 40, transposed=False)  # still a plain product to quantize
    kernel, calls = cpu_kernels.Bf16Matmul.__call__, []
    monkeypatch.setattr(cpu_kernels.Bf16Matmul, "__call__", lambda m, x: calls.append(x.numel() // 40) or kernel(m, x))
    few = bf16_linear.KERNEL_ROWS - 1
    for shape in [(1, 40), (1, few, 40), (bf16_linear.KERNEL_ROWS, 40)]:
        x = torch.randn(shape).bfloat16()
        expected = torch.nn.functional.linear(x.float(), model[0].weight.float(), model[0].bias.float())
        assert torch.allclose(model[0](x).float(), expected, rtol=2 ** -7, atol=1e-2)
    assert calls == [1, few]
    assert model.float()[0](torch.randn(2, 40)).dtype == torch.float32 and calls == [1, few]


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return set(next(line for line in cpuinfo if line.startswith("flags")).split(":")[1].split())


def test_many_rows_take_torch_s_bf16_matmul_only_where_the_cpu_has_bf16_instructions(monkeypatch):
    """Without AVX-512 BF16 or AMX torch's bf16 matmul widens as it goes, several times slower than
    fp32's or the kernels': there a bf16 layer's 128 rows take the bf16 kernel and its 1024 rows
    torch's matmul in fp32, and int8 and int4 layers' rows their kernels at both counts; with them,
    the kernels stop at their thresholds and torch's bf16 matmul runs."""
    hardware = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert cpu_kernels.bf16_matmul_in_hardware() == hardware
    calls = []
    for kind in (cpu_kernels.Bf16Matmul, cpu_kernels.Int8Matmul, cpu_kernels.Int4Matmul):
        monkeypatch.setattr(kind, "__call__",
                            lambda m, rows, call=kind.__call__: calls.append(type(m).__name__) or call(m, rows))
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: calls.append(f"torch {x.dtype}") or linear(x, *a))
    dequantize = zerolite.quant.linear.int4_dequantize_transposed
    monkeypatch.setattr(zerolite.quant.linear, "int4_dequantize_transposed",
                        lambda out, *a: calls.append(f"int4 into {out.dtype}") or dequantize(out, *a))

    weight = torch.randn(64, 96)
    bf16_layer = torch.nn.Linear(96, 64, bias=False).bfloat16()
    use_bf16_kernel(bf16_layer)
    int8_layer = Int8Linear(64, 96, torch.bfloat16, None, dequantize=False)
    int8_layer.weight, int8_layer.weight_scale = quantize_int8(weight.bfloat16())
    scheme = WeightScheme.parse("int4", 32)
    int4_layer = Int4Linear(64, 96, scheme, torch.bfloat16, None, dequantize=False)
    q, int4_layer.weight_scale_zero = quantize_int4(weight.bfloat16(), 32)
    int4_layer.weight = pack_int4(q, scheme.packing)
    dense = [bf16_layer.weight.float(), int8_layer.dequantized(torch.float32), int4_layer.dequantized(torch.float32)]
    seen = {}
    for rows in (128, 1024):  # 1024: from TILES_INT4_DEQUANTIZE_ROWS on, AMX dequantises too
        x = torch.randn(rows, 96).bfloat16()
        for layer, weights in zip([bf16_layer, int8_layer, int4_layer], dense, strict=True):
            calls.clear()
            expected = x.float() @ weights.t()
            assert torch.allclose(layer(x).float(), expected, rtol=2 ** -7, atol=2e-2 * expected.abs().max().item())
            seen[type(layer).__name__, rows] = calls[-1]
    bf16 = "torch torch.bfloat16"
    if hardware:
        assert seen == {("Bf16KernelLinear", 128): bf16, ("Bf16KernelLinear", 1024): bf16,
                        ("Int8Linear", 128): bf16, ("Int8Linear", 1024): bf16,
                        ("Int4Linear", 128): seen["Int4Linear", 128], ("Int4Linear", 1024): "int4 into torch.bfloat16"}
    else:
        assert seen == {("Bf16KernelLinear", 128): "Bf16Matmul", ("Bf16KernelLinear", 1024): "torch torch.float32",
                        ("Int8Linear", 128): "Int8Matmul", ("Int8Linear", 1024): "Int8Matmul",
                        ("Int4Linear", 128): "Int4Matmul", ("Int4Linear", 1024): "Int4Matmul"}


def test_the_kernels_take_rows_of_any_layout_and_dtype(path):
    """A transposed or bf16 input is made fp32 rows first; the outputs are the same."""
    q, scale = quantize_int8(torch.randn(96, 40))
    x = torch.randn(40, 5)
    assert torch.equal(cpu_kernels.int8_matmul(x.t(), q, scale), cpu_kernels.int8_matmul(x.t().contiguous(), q, scale))


def test_a_packing_the_kernel_was_not_given_computes_something_else():
    """The kernel reads the packing it is told: the same bytes read as another packing differ
    (so a wrong record in a manifest could not pass the tests above by chance)."""
    q, scale_zero = quantize_int4(torch.randn(128, 64), 32)
    halves, pairs = Int4Packing(64, "halves"), Int4Packing(64, "pairs")
    packed = pack_int4(q, halves)
    assert torch.equal(unpack_int4(packed, 128, 64, halves), q)
    x = torch.randn(1, 64)
    assert not torch.allclose(cpu_kernels.int4_matmul(x, packed, scale_zero, 128, 32, halves),
                              cpu_kernels.int4_matmul(x, packed, scale_zero, 128, 32, pairs))


def test_an_unknown_or_missing_path_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, "neon")
    message = f"ZEROLITE_CPU_KERNEL=neon: this CPU runs the kernel paths {', '.join(PATHS)}"
    with pytest.raises(ZeroliteError, match=message):
        cpu_kernels.int8_matmul(torch.randn(1, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))


def test_shapes_that_do_not_match_the_weight_are_refused():
    q, scale_zero = quantize_int4(torch.randn(64, 64), 32)
    packing = CANDIDATES[0]
    with pytest.raises(ValueError, match="does not match"):
        cpu_kernels.int4_matmul(torch.randn(1, 96), pack_int4(q, packing), scale_zero, 64, 32, packing)
    with pytest.raises(ValueError, match=r"rows must be a CPU tensor \[rows, 8\]"):
        cpu_kernels.int8_matmul(torch.randn(8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))


def test_int4_and_int8_run_at_avx512bf16_and_amx_as_at_avx512vnni(monkeypatch):
    """The paths are levels: a kernel with nothing of its own at a level runs the best below it
    (on a CPU with neither level, nothing to compare); amx's int4 tiles, from 8 rows on, not for 5."""
    q4, scale_zero = quantize_int4(torch.randn(80, 100), 32)
    packing = CANDIDATES[0]
    packed = pack_int4(q4, packing)
    q8, scale = quantize_int8(torch.randn(33, 100))
    x = torch.randn(5, 100).bfloat16()
    outputs = []
    for level in [p for p in ("avx512vnni", SAME_AS_BELOW, INT4_ONLY) if p in PATHS]:
        monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, level)
        outputs.append([cpu_kernels.int4_matmul(x, packed, scale_zero, 80, 32, packing),
                        cpu_kernels.int4_dequantize_transposed(torch.empty(100, 80), packed, scale_zero, 32, packing),
                        cpu_kernels.int8_matmul(x, q8, scale)])
    assert all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other))
