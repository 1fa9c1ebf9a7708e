"""One memory model: the planner counts what the runtime allocates, and one function decides the batch size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from support.tiny_models import tiny_config
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES
from zerolite.memory_model import ModelShape, kv_bytes_per_token, prefill_activation_bytes
from zerolite.planner.model_costs import ModelCosts
from zerolite.quant.linear import QuantizedLinear, cpu_dequantize_workspace, dense_bytes, dequantize_workspace
from zerolite.runtime.batching import MAX_BATCH, decide_batch_size, host_kv_share
from zerolite.runtime.kv_cache import offloaded_share


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_planner_counts_a_quantized_layer_s_gpu_memory_as_the_runtime_does(make_layout, weights):
    """The dequantised copy a GPU keeps of a resident layer, and the workspace streamed ones take:
    from the config (the planner) and from the converted layout (budgets and preflight) alike."""
    layout = Layout.open(make_layout("llama", layers=2, weights=weights))
    manifest = layout.manifest
    costs = ModelCosts.from_config(AutoConfig.from_pretrained(layout.side_folder), DTYPES[manifest.dtype])
    fmt = costs.formats[weights]
    assert fmt.dense_bytes == max(dense_bytes(manifest, name) for name in manifest.layer_names) > 0
    assert fmt.workspace_bytes == dequantize_workspace(manifest) > 0
    assert costs.formats["stored"].dense_bytes == costs.formats["stored"].workspace_bytes == 0


def test_a_cpu_prefill_s_scratch_buffer_is_the_workspace_the_plan_counts(make_layout, monkeypatch):
    """A prompt past the kernels' rows dequantises each int4 weight's transpose into the layers'
    shared scratch buffer: the host budget and preflight set that much aside (the stored width,
    a partial last group's padding included, bounds it). (Where the CPU has no bf16 instructions
    the kernels take every row count and the buffer is never taken: the threshold as elsewhere.)"""
    import zerolite
    import zerolite.quant.linear

    monkeypatch.setattr(zerolite.quant.linear, "INT4_DEQUANTIZE_ROWS", 64)

    layout = make_layout("llama", layers=2, weights="int4", dtype="bf16")
    with zerolite.load(layout, device="cpu", offload="cpu", show_progress=False) as lm:
        lm.model(input_ids=torch.randint(3, 100, (1, 80)))
        (scratch,) = {m.scratch for m in lm.model.modules() if isinstance(m, QuantizedLinear)}
    assert 0 < scratch._buffer.numel() <= cpu_dequantize_workspace(Layout.open(layout).manifest)


def test_the_model_shape_is_read_once_for_k_v_attention_and_activations():
    config = tiny_config("llama")
    shape = ModelShape.of(config)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.attending_layers) == (4, 2, 16, 3)
    assert kv_bytes_per_token(config, DTYPES["float16"]) == 2 * 3 * 2 * 16 * 2
    assert ModelCosts.from_config(config).attention_width == shape.attention_width == 64
    # the prefill's scores grow with the square of the prompt, the rest in proportion
    tokens = DTYPES["float32"]
    assert (prefill_activation_bytes(shape, 20, tokens) - prefill_activation_bytes(shape, 10, tokens)
            > prefill_activation_bytes(shape, 10, tokens) - prefill_activation_bytes(shape, 0, tokens))


def test_one_function_decides_the_batch_size():
    def never() -> int:
        raise AssertionError("what fits is asked only for auto")

    assert decide_batch_size(8, drafting=True, fits=never) == 1  # a draft runs one sequence at a time
    assert decide_batch_size(8, planned=2, fits=never) == 8       # given: as given, whatever the plan chose
    assert decide_batch_size(None) is None                        # auto, before the model is loaded
    assert decide_batch_size(None, planned=16, fits=lambda: 40) == 16
    assert decide_batch_size(None, planned=64, fits=lambda: 40) == 40
    assert decide_batch_size(None, fits=lambda: MAX_BATCH) == MAX_BATCH


def test_a_hybrid_s_k_v_offloaded_is_counted_as_a_share_of_its_bytes_not_of_its_layers():
    """Jamba's state-space layers hold no K/V and are never offloaded: --kv-offload 1 puts every
    byte of K/V in host memory, though only half the layers (--batch-size auto once counted half)."""
    jamba = tiny_config("jamba", layers=4)
    assert offloaded_share(jamba, 1.0) == 0.5
    assert host_kv_share(jamba, 1.0, torch.float32) == 1.0 and host_kv_share(jamba, 0.5, torch.float32) == 0.5
    llama = tiny_config("llama", layers=4)
    assert host_kv_share(llama, 0.5, torch.float32) == offloaded_share(llama, 0.5) == 0.5
