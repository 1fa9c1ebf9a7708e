"""K/V at 8 and 4 bits (--kv-bits): the codec against a plain quantize-dequantize, generation equal
token for token to transformers' generate with the same quantized cache in RAM (attention layers,
GQA, sliding windows, linear-attention layers left as they are; on the device and in host memory;
on the CPU and the simulated device), the cache really holding the packed bytes, and the memory
model counting them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerolite
from support.helpers import greedy
from support.simulated_device import SimulatedDevice
from support.tiny_models import tiny_config
from zerolite.errors import ZeroliteError
from zerolite.io.device import resolve
from zerolite.memory_model import kv_bytes_per_token, kv_group_size, kv_row_bytes
from zerolite.quant.kv_codec import KVCodec
from zerolite.runtime import batching
from zerolite.runtime.host_memory import host_room
from zerolite.runtime.kv_cache import PartialOffloadCache, QuantizedHostLayer, QuantizedStates
from zerolite.runtime.policy import Policy

ROWS = [[5, 17, 33, 9, 44, 61, 70], [12, 90]]  # one batch: the short prompt left-padded
NEW_TOKENS = 4


def reference_round_trip(states: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize and dequantize each token's head in groups, in fp32, the plain way: int8 symmetric
    around the group's largest magnitude, int4 from the group's minimum to its maximum; the scale
    and the zero rounded to the states' dtype, as they are stored."""
    dtype, width = states.dtype, states.shape[-1]
    group = kv_group_size(width)
    out = torch.empty(states.shape, dtype=torch.float32)
    for start in range(0, width, group):
        x = states[..., start:start + group].float()
        if bits == 8:
            scale = (x.abs().amax(-1, keepdim=True) / 127).to(dtype).float()
            safe = torch.where(scale == 0, 1.0, scale)
            out[..., start:start + group] = (x / safe).round().clamp(-127, 127) * scale
        else:
            low = x.amin(-1, keepdim=True).to(dtype).float()
            scale = ((x.amax(-1, keepdim=True) - low) / 15).to(dtype).float()
            safe = torch.where(scale == 0, 1.0, scale)
            out[..., start:start + group] = ((x - low) / safe).round().clamp(0, 15) * scale + low
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_codec_packs_scales_beside_codes_and_decodes_as_the_plain_round_trip(bits, dtype):
    torch.manual_seed(0)
    for width in (16, 7, 256):  # one group; an odd width (a nibble of padding); two groups of 128
        states = (torch.randn(2, 3, 5, width) * torch.logspace(-2, 2, 5)[:, None]).to(dtype)  # scales apart by token
        states[1, 2, 3] = 0  # a group of zeros: scale 0
        codec = KVCodec(bits)
        packed = codec.encode(states)
        assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, kv_row_bytes(width, dtype, bits))
        decoded = codec.decode(packed, dtype, width)
        assert decoded.dtype == dtype and decoded.shape == states.shape
        expected = reference_round_trip(states, bits)
        # decoded in dtype: one rounding of the product (and the sum) to dtype apart from fp32's
        tolerance = 2 * torch.finfo(dtype).eps * expected.abs().amax(-1, keepdim=True)
        assert ((decoded.float() - expected).abs() <= tolerance).all(), (decoded.float() - expected).abs().max()
        # and within a step of the states (half of one, but for the codes clamped where the stored scale rounded down)
        x = states.float().unflatten(-1, (-1, kv_group_size(width)))
        step = x.abs().amax(-1) / 127 if bits == 8 else (x.amax(-1) - x.amin(-1)) / 15
        error = (decoded.float() - states.float()).unflatten(-1, x.shape[-2:]).abs().amax(-1)
        assert (error <= step * (1 + 2 ** -6)).all()
        assert not decoded[1, 2, 3].any()
        # a row of zero bytes (a row that joins a running batch) decodes to zeros
        assert not codec.decode(torch.zeros_like(packed), dtype, width).any()


def quantized_reference(source, bits: int):
    """transformers' greedy generation in RAM with zerolite's quantized cache passed in."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()  # aligned, as zerolite's slots are (test_executor)
    cache = PartialOffloadCache(model.config, 0.0, resolve("cpu"), bits=bits)
    return greedy(model, ROWS, NEW_TOKENS, logits=True, cache=cache)


def assert_same(expected, got) -> None:
    assert torch.equal(expected.sequences, got.sequences.cpu())
    for e, g in zip(expected.logits, got.logits, strict=True):
        assert torch.allclose(e, g.cpu(), rtol=0, atol=1e-5), (e - g.cpu()).abs().max()


def assert_packed(cache, host: bool) -> None:
    """The cache holds the packed uint8 rows of every attention layer (in host memory where host)."""
    quantized = [layer for layer in cache.layers if isinstance(layer, QuantizedStates)]
    assert quantized and all(layer.keys.dtype == torch.uint8 and layer.values.dtype == torch.uint8
                             for layer in quantized)
    assert any(isinstance(layer, QuantizedHostLayer) for layer in quantized) == host


# llama: grouped-query attention (4 heads, 2 K/V heads), on the device at 8 bits, in host memory at 4;
# gemma2: sliding-window layers (on the device) between full ones (in host memory)
@pytest.mark.parametrize(("arch", "bits", "kv_offload"), [("llama", 8, 0.0), ("llama", 4, 1.0), ("gemma2", 4, 1.0)])
def test_generation_with_quantized_kv_equals_transformers_with_the_same_cache(arch, bits, kv_offload, make_source,
                                                                               make_layout):
    expected = quantized_reference(make_source(arch, layers=4), bits)
    with zerolite.load(make_layout(arch, layers=4), device="cpu", offload="nvme", cpu_memory=0, kv_offload=kv_offload,
                       kv_bits=bits, show_progress=False) as lm:
        assert_same(expected, greedy(lm, ROWS, NEW_TOKENS, logits=True))
        cache = lm.new_cache()
        greedy(lm, ROWS, 2, cache=cache)
        assert_packed(cache, host=kv_offload > 0)


def test_quantized_kv_in_host_memory_on_the_simulated_device_equals_transformers(make_source, make_layout):
    """The packed rows cross the simulated link each step, fetched ahead and appended in order."""
    expected = quantized_reference(make_source("llama", layers=4), 4)
    sim = SimulatedDevice(seed=3)
    with sim.watching(), zerolite.load(make_layout("llama", layers=4), device=sim, offload="nvme", cpu_memory=0,
                                       gpu_memory=0, kv_offload=0.5, kv_bits=4, show_progress=False) as lm:
        assert_same(expected, greedy(lm, ROWS, NEW_TOKENS, logits=True))
        cache = lm.new_cache()
        greedy(lm, ROWS, 2, cache=cache)
        assert_packed(cache, host=True)


def test_linear_attention_layers_keep_their_state_as_it_is():
    """qwen3_next's gated delta-net layers hold a state, not K/V: only its attention layers are quantized."""
    config = tiny_config("qwen3_next", layers=4)
    kinds = [type(layer).__name__ for layer in PartialOffloadCache(config, 0.0, resolve("cpu"), bits=4).layers]
    assert kinds == ["LinearAttentionLayer", "QuantizedDeviceLayer"] * 2, kinds
    # two attention layers' keys and values, 2 K/V heads of 16 each
    assert kv_bytes_per_token(config, torch.bfloat16, 4) == 2 * 2 * 2 * kv_row_bytes(16, torch.bfloat16, 4)


def test_the_memory_model_counts_what_the_quantized_cache_holds(make_layout, monkeypatch):
    """Per token and layer, the bytes the cache's tensors take are kv_bytes_per_token's at each
    bits; and --batch-size auto fits about 2x and 3.5x the sequences of 16-bit K/V."""
    with zerolite.load(make_layout("llama", layers=4), device="cpu", offload="cpu", show_progress=False) as lm:
        tokens = len(ROWS[0]) + 3  # the last token chosen is not fed
        for bits in (16, 8, 4):
            cache = PartialOffloadCache(lm.config, 0.5, resolve("cpu"), bits=bits)
            greedy(lm, ROWS, 4, exact=True, cache=cache)
            held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
            assert held == len(ROWS) * tokens * kv_bytes_per_token(lm.config, lm.model.dtype, bits)
    # a shape whose K/V dominates (128-wide heads, many layers), in 10 GB of host memory
    config = tiny_config("llama", layers=64, num_attention_heads=1, num_key_value_heads=1, head_dim=128)
    monkeypatch.setattr(batching, "host_room", lambda: 10 * 10**9)
    batches = {}
    for bits in (16, 8, 4):
        lm = SimpleNamespace(model=SimpleNamespace(config=config, dtype=torch.bfloat16), device=resolve("cpu"),
                             policy=Policy(device="cpu", kv_bits=bits))
        batches[bits] = batching.largest_batch(lm, [4] * 4096, 2000)
    assert batches[8] >= 1.9 * batches[16] and batches[4] >= 3.5 * batches[16], batches


def test_host_room_is_the_tightest_memory_cgroup_s(tmp_path):
    """v1: this process's cgroup and every one above it, reclaimable page cache counted as room."""
    root = tmp_path / "sys"
    leaf = root / "memory" / "jobs" / "one"
    leaf.mkdir(parents=True)
    for folder, limit, usage, cache in ((leaf, 3_000_000, 2_500_000, 400_000), (leaf.parent, 10_000_000, 9_000_000, 0)):
        (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (folder / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {cache}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:devices:/\n4:memory:/jobs/one\n0::/\n")
    assert host_room(proc, root) == 900_000  # the leaf's 500 kB and 400 kB of page cache, under the parent's 1 MB
    (leaf.parent / "memory.usage_in_bytes").write_text("9_500_000".replace("_", ""))
    assert host_room(proc, root) == 500_000


def test_a_bad_kv_bits_is_one_clear_error(make_layout):
    """(test_bad_input: the command line's one line.)"""
    with pytest.raises(ZeroliteError, match="`kv_bits` .* 16, 8, 4, not 3"):
        zerolite.load(make_layout("llama", layers=4), device="cpu", kv_bits=3, show_progress=False)



def test_the_running_batch_moves_packed_rows_as_it_moves_states():
    """A row joining (zero rows), columns reordered in place, a row and a column leaving: done to
    the packed rows (on the device and in host memory), they decode to what the same changes make
    of the decoded states. (Whole runs of the running batch do not compare token for token with
    generate: a batch's matmuls round differently, which at 8 or 4 bits can tip a code.)"""
    from transformers import DynamicCache

    from zerolite.decoding.running_batch import RunningBatch

    config = tiny_config("llama", layers=2)
    quantized = PartialOffloadCache(config, 0.5, resolve("cpu"), bits=4)
    plain = DynamicCache(config=config)
    torch.manual_seed(0)
    for index in range(2):
        keys, values = torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4, 16)
        plain.update(*quantized.update(keys, values, index), index)
    for cache in (quantized, plain):
        batch = RunningBatch.__new__(RunningBatch)
        batch.cache = cache
        batch._each_layer(lambda states: torch.cat([states, states.new_zeros((1, *states.shape[1:]))]))
        batch._close_holes(2, 2, [2, 1, 2, 0])
        batch._each_layer(lambda states: states.index_select(0, torch.tensor([0, 2, 3]))[:, :, 1:])
    codec = KVCodec(4)
    assert isinstance(quantized.layers[1], QuantizedHostLayer)
    for packed, states in zip(quantized.layers, plain.layers):
        assert packed.keys.dtype == torch.uint8 and packed.keys.shape[:3] == states.keys.shape[:3] == (3, 2, 3)
        assert torch.equal(codec.decode(packed.keys, torch.float32, 16), states.keys)
        assert torch.equal(codec.decode(packed.values, torch.float32, 16), states.values)
