"""int8 layouts: the decoder layers' Linear weights quantized at convert, run through the same
streamed paths, against transformers running the same integer weights dequantised in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import zerolite
import zerolite.quantized_linear
from zerolite.convert import convert
from zerolite.errors import ZeroliteError
from zerolite.io import IoEngine
from zerolite.layout import Layout
from zerolite.quantize import SCALE_SUFFIX
from zerolite.quantized_linear import QuantizedLinear
from zerolite.store import DiskStore

ARCHS = ["llama", "mistral", "bloom", "opt", "gpt2"]
LAYERS = 4
NEW_TOKENS = 10
PROMPTS = torch.tensor([[5, 17, 33, 9, 44, 61, 70], [0, 0, 0, 0, 0, 12, 90]])
MASK = torch.tensor([[1] * 7, [0] * 5 + [1] * 2])
MIN_COSINE = 0.999
MIN_AGREEMENT = 0.99


def greedy(model_or_lm):
    return model_or_lm.generate(input_ids=PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def dequantised_reference(source, layout):
    """transformers' model on the source, each quantized weight replaced by the layout's integers
    times their scales, in fp32."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    layout = Layout.open(layout)
    disk = DiskStore(layout, IoEngine())
    with torch.no_grad():
        for block in layout.blocks:
            tensors = disk.read(block.name)
            for name, scale in tensors.items():
                if not name.endswith(".weight" + SCALE_SUFFIX):
                    continue
                path = name.removesuffix(".weight" + SCALE_SUFFIX)
                weight = tensors[path + ".weight"].float() * scale.float()[:, None]
                module = model.get_submodule(path)
                module.weight.copy_(weight.t() if isinstance(module, Conv1D) else weight)
    return model


@pytest.fixture(scope="module", params=ARCHS)
def quantized(request, make_source, make_layout):
    arch = request.param
    source = make_source(arch, layers=LAYERS)
    layout = make_layout(arch, layers=LAYERS, weights="int8")
    return layout, greedy(dequantised_reference(source, layout))


def assert_close_to_reference(expected, got) -> None:
    for step, (e, g) in enumerate(zip(expected.logits, got.logits, strict=True)):
        cosine = torch.nn.functional.cosine_similarity(e.float(), g.float(), dim=-1)
        assert cosine.min() >= MIN_COSINE, f"step {step}: cosine {cosine.min():.5f}, largest difference {(e - g).abs().max():.2e}"
    new = slice(PROMPTS.shape[1], None)
    agreement = (expected.sequences[:, new] == got.sequences[:, new]).float().mean()
    assert agreement >= MIN_AGREEMENT, f"greedy tokens agree at {agreement:.1%} of positions"


@pytest.mark.parametrize("dequantize_rows", [zerolite.quantized_linear.DEQUANTIZE_ROWS, 1], ids=["kernel", "dequantised"])
@pytest.mark.parametrize("setup", [dict(offload="nvme", cpu_memory=0), dict(offload="cpu"), dict(offload="none")])
def test_int8_layout_matches_its_dequantised_weights_on_cpu(quantized, setup, dequantize_rows, monkeypatch):
    """Both CPU paths: the int8 kernel (these prompts' rows are below the threshold) and, with the
    threshold at 1 row, the dequantise-then-matmul path a long prefill takes."""
    monkeypatch.setattr(zerolite.quantized_linear, "DEQUANTIZE_ROWS", dequantize_rows)
    layout, expected = quantized
    with zerolite.load(layout, device="cpu", show_progress=False, **setup) as lm:
        assert any(isinstance(m, QuantizedLinear) for m in lm.model.modules())
        assert_close_to_reference(expected, greedy(lm))


@pytest.mark.cuda
def test_int8_layout_matches_its_dequantised_weights_on_a_gpu(quantized, gpu):
    """The GPU path: the int8 bytes cross to the device, where they are dequantised for the matmul."""
    layout, expected = quantized
    with zerolite.load(layout, device=gpu, offload="nvme", cpu_memory=0, gpu_memory=0, show_progress=False) as lm:
        assert_close_to_reference(expected, greedy(lm))


def test_int8_moves_about_half_the_bytes_of_bf16_per_step(make_source, tmp_path):
    source = make_source("llama", layers=LAYERS, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=8)
    base = convert(source, tmp_path / "bf16", dtype="bf16", show_progress=False)
    int8 = convert(source, tmp_path / "int8", dtype="bf16", weights="int8", show_progress=False)
    assert int8.quantization["weights"] == "int8" and base.quantization is None
    ratio = int8.nbytes(int8.layer_names) / base.nbytes(base.layer_names)
    assert ratio <= 0.55, ratio
    with zerolite.load(tmp_path / "int8", device="cpu", cpu_memory=0, prefetch_depth=1, show_progress=False) as lm:
        greedy(lm)  # depth 1: nothing is read ahead, so each forward reads the layers once
        assert lm.bytes_read == NEW_TOKENS * int8.nbytes(int8.layer_names)


def test_a_converted_layout_is_reused_only_for_the_same_weights(make_source, tmp_path):
    source = make_source("llama", layers=LAYERS)
    first = convert(source, tmp_path / "layout", show_progress=False)
    again = convert(source, tmp_path / "layout", weights="int8", show_progress=False)
    assert first.quantization is None and again.quantization["weights"] == "int8"
    assert convert(source, tmp_path / "layout", weights="int8", show_progress=False) == again


def test_bad_weights_write_nothing(make_source, tmp_path):
    with pytest.raises(ZeroliteError, match="unknown --weights"):
        convert(make_source(), tmp_path / "out", weights="int3", show_progress=False)
    assert not (tmp_path / "out").exists()
