"""Quantized matmuls where the device has memory of its own (issue 37, defect 7): int4 through the
fused kernel for a decode step's few rows, its packing made once per slot fill; int4 and int8
dequantised in few passes into one shared buffer for more rows. Here the fused kernel is torch's CPU
implementation behind the same packing input as the CUDA one (fused_on_cpu), and the device the
simulated one; the CUDA kernel itself is checked where it runs, by gpu_int4.checked at load."""

from __future__ import annotations

import pytest
import torch

import zerolite
import zerolite.quant.linear
from support.helpers import greedy
from support.simulated_device import SimulatedDevice
from test_quantized import LAYERS, NEW_TOKENS, ROWS, SCHEMES, dequantised_reference, teacher_forced_logits
from zerolite.quant.gpu_int4 import Int4Kernel, checked, inner_k_tiles
from zerolite.quant.int4_packing import CANDIDATES, pack_int4
from zerolite.quant.linear import Int4Linear, Int8Linear, Scratch, dequantize_int4, dequantize_int4_into
from zerolite.quant.quantize import SCALE_ZERO_SUFFIX, WeightScheme

CPU = torch.device("cpu")


def split_columns(paired: torch.Tensor) -> torch.Tensor:
    """The CUDA packer's input (uint8 [out, in / 2], the even column in the high nibble) back to
    int32 [out, in], as CUDA's documentation of _convert_weight_to_int4pack reads it."""
    return torch.stack([paired >> 4, paired & 15], dim=-1).flatten(-2).to(torch.int32)


def fused_on_cpu(calls: list | None = None) -> Int4Kernel:
    """torch's CPU int4 kernel, taking the CUDA packer's input; calls records ("pack" or "mm", rows)."""
    def pack(paired, tiles):
        if calls is not None:
            calls.append(("pack", paired.shape[0]))
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(split_columns(paired), tiles)

    def mm(rows, packed, group_size, scale_zero):
        if calls is not None:
            calls.append(("mm", rows.shape[0]))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scale_zero)

    return Int4Kernel(pack, mm)


def not_built(*args):
    raise RuntimeError("_weight_int4pack_mm_cuda is not available for build.")


def test_the_probe_takes_a_kernel_that_reads_the_packing_and_refuses_one_that_misreads_it():
    kernel = fused_on_cpu()
    assert checked(kernel, CPU) is kernel
    swapped = Int4Kernel(lambda paired, tiles: kernel.pack((paired << 4) | (paired >> 4), tiles), kernel.mm)
    assert checked(swapped, CPU) is None  # the odd column's nibble taken for the even one's
    assert checked(Int4Kernel(kernel.pack, not_built), CPU) is None  # a GPU it was not built for


def int4_module(out_features: int, in_features: int, group_size: int, kernel=None, scratch=None):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.02
    scheme = WeightScheme.parse("int4", group_size)
    stored = scheme.quantize(weight.bfloat16())
    module = Int4Linear(out_features, in_features, scheme, torch.bfloat16, None, dequantize=True, scratch=scratch,
                        kernel=kernel)
    module.weight, module.weight_scale_zero = stored[""], stored[SCALE_ZERO_SUFFIX]
    exact = dequantize_int4(stored[""], stored[SCALE_ZERO_SUFFIX].float(), group_size, scheme.packing,
                            torch.float32)[:, :in_features]
    return module, exact


@pytest.mark.parametrize("in_features", [512, 576], ids=["whole-groups", "a-partial-group"])
def test_a_gpus_int4_paths_compute_what_the_weights_dequantise_to(in_features):
    """Fused below FUSED_INT4_ROWS (its packing made at the first call on a bound weight, kept for
    the next calls, made again once the block is unbound and bound anew); dequantised into the
    shared scratch buffer from there on."""
    calls = []
    module, exact = int4_module(1024, in_features, 64, fused_on_cpu(calls), Scratch())
    for rows in (1, 16, zerolite.quant.linear.FUSED_INT4_ROWS):
        x = torch.randn(rows, in_features).bfloat16()
        expected = x.float() @ exact.t()
        for _ in range(2):
            relative = (module(x).float() - expected).norm() / expected.norm()
            assert relative < 1e-2, (rows, relative)
    assert calls == [("pack", 1024), ("mm", 1), ("mm", 1), ("mm", 16), ("mm", 16)]
    module.unbound()
    module(torch.randn(1, in_features).bfloat16())
    assert calls[-2:] == [("pack", 1024), ("mm", 1)]


@pytest.mark.parametrize("packing", CANDIDATES, ids=str)
def test_int4_dequantised_in_few_passes_equals_the_reference(packing):
    """Every CPU's packed order, rows past the last whole block of rows included."""
    q = torch.randint(0, 16, (112, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed, scale_zero = pack_int4(q, packing), torch.randn(4, 112, 2)
    out = torch.empty(112, 256)
    dequantize_int4_into(out, packed, scale_zero, 64, packing)
    assert torch.allclose(out, dequantize_int4(packed, scale_zero, 64, packing, torch.float32), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_on_a_gpu_scales_the_widened_weights_product(dtype):
    """The scale applied to the output (bf16, fp32) or, where the unscaled sums could overflow, to
    the widened weight (fp16): both as the dequantised weight's product."""
    torch.manual_seed(0)
    module = Int8Linear(96, 64, dtype, None, dequantize=True, scratch=Scratch())
    module.weight = torch.randint(-127, 128, (96, 64), dtype=torch.int8)
    module.weight_scale = (torch.rand(96) * 0.01 + 1e-3).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    expected = x.float() @ (module.weight.float() * module.weight_scale.float()[:, None]).t()
    relative = (module(x).float() - expected).norm() / expected.norm()
    assert relative < (1e-5 if dtype == torch.float32 else 1e-2), relative


def test_int4_on_a_simulated_gpu_runs_fused_below_the_row_threshold(make_source, make_layout, monkeypatch):
    """bf16 int4 layers streamed through the simulated device (which reports cuda), its fused kernel
    torch's CPU one: a forward of fewer rows than the threshold multiplies through it, one of more
    dequantises, and both stay within the int4 reference tolerance (no further from transformers
    on the same weights in fp32 than twice that model's own bf16 error)."""
    source = make_source("llama", layers=LAYERS)
    layout = make_layout("llama", layers=LAYERS, dtype="bf16", **SCHEMES["int4"])
    reference = dequantised_reference(source, layout)
    sequences = greedy(reference, ROWS, NEW_TOKENS, logits=True).sequences
    expected = teacher_forced_logits(reference, sequences)
    bf16_error = (teacher_forced_logits(dequantised_reference(source, layout, torch.bfloat16), sequences)
                  - expected).abs().max()
    calls = []
    monkeypatch.setattr(zerolite.quant.linear, "int4_kernel", lambda device: fused_on_cpu(calls))
    rows = sequences.numel()
    sim = SimulatedDevice(seed=4, reports_cuda=True)
    with sim.watching(), zerolite.load(layout, device=sim, offload="nvme", cpu_memory=0, gpu_memory=0,
                                       show_progress=False) as lm:
        quantized = [m for m in lm.model.modules() if isinstance(m, Int4Linear)]
        for threshold in (rows + 1, rows):
            monkeypatch.setattr(zerolite.quant.linear, "FUSED_INT4_ROWS", threshold)
            calls.clear()
            error = (teacher_forced_logits(lm.model, sequences) - expected).abs().max()
            assert error <= 2 * bf16_error, (threshold, error, bf16_error)
            fused = [rows_in for kind, rows_in in calls if kind == "mm"]
            assert fused == ([rows] * len(quantized) if threshold > rows else []), fused
            assert sum(kind == "pack" for kind, _ in calls) == len(fused)  # one forward: one call per fill
    assert inner_k_tiles(160) == 2 and inner_k_tiles(64) == 4 and inner_k_tiles(4096) == 8
