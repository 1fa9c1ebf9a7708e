"""K/V at 8 and 4 bits (--kv-bits): the codecs against a plain quantize-dequantize (token by token;
4-bit keys per channel over groups of tokens), a layer reading its stored groups and its waiting
keys as that plain reference says, generation equal token for token to transformers' generate with
the same quantized cache in RAM (attention layers, GQA, sliding windows, linear-attention layers
left as they are; on the device and in host memory; on the CPU and the simulated device), the cache
really holding the packed bytes, and the memory model counting them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerolite
from support.helpers import greedy
from support.simulated_device import SimulatedDevice
from support.tiny_models import tiny_config
from zerolite import memory_model
from zerolite.errors import ZeroliteError
from zerolite.io.device import resolve
from zerolite.io.engine import IoEngine
from zerolite.memory_model import kv_bytes_per_token, kv_group_size, kv_key_row_bytes, kv_row_bytes, kv_waiting_bytes
from zerolite.quant.kv_codec import KeyGroupCodec, KVCodec
from zerolite.runtime import batching
from zerolite.runtime.host_attention import HostAttendingCaches, QuantizedHostAttendedLayer
from zerolite.runtime.host_memory import host_room
from zerolite.runtime.kv_cache import (
    OffloadedCaches,
    PartialOffloadCache,
    QuantizedDeviceLayer,
    QuantizedDiskLayer,
    QuantizedHostLayer,
    QuantizedStates,
)
from zerolite.runtime.kv_disk import KVDisk
from zerolite.runtime.policy import Policy

ROWS = [[5, 17, 33, 9, 44, 61, 70], [12, 90]]  # one batch: the short prompt left-padded
NEW_TOKENS = 4
KEY_GROUP = 4  # 4-bit keys' group of tokens in these tiny runs, so that groups fill (and keys wait) in them


@pytest.fixture
def small_key_groups(monkeypatch):
    monkeypatch.setattr(memory_model, "KV_KEY_TOKENS", KEY_GROUP)


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


def reference_key_groups(states: torch.Tensor, tokens: int) -> torch.Tensor:
    """4-bit keys the plain way, in fp32: each channel from its minimum to its maximum over each
    group of tokens tokens, the scale and the zero rounded to the states' dtype."""
    dtype = states.dtype
    x = states.float().unflatten(-2, (-1, tokens))
    low = x.amin(-2, keepdim=True).to(dtype).float()
    scale = ((x.amax(-2, keepdim=True) - low) / 15).to(dtype).float()
    safe = torch.where(scale == 0, 1.0, scale)
    return (((x - low) / safe).round().clamp(0, 15) * scale + low).flatten(-3, -2)


def outlying_keys(*shape: int) -> torch.Tensor:
    """Keys as a model's are: a few channels far larger than the rest, in every token, one off zero."""
    keys = torch.randn(*shape)
    keys[..., 0] *= 40
    keys[..., 1] = keys[..., 1] * 5 + 30
    return keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_key_group_codec_decodes_as_the_plain_per_channel_round_trip(dtype):
    torch.manual_seed(0)
    codec = KeyGroupCodec(tokens=8)
    for width in (16, 7, 128):  # an odd width: a nibble of padding
        states = outlying_keys(2, 3, 16, width).to(dtype)
        states[1, 2, 8:] = 0  # a group of zeros: scale 0
        packed = codec.encode(states)
        assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 16, kv_key_row_bytes(width, dtype, 4, 8))
        expected = reference_key_groups(states, 8)
        waiting = torch.randn(2, 3, 5, width).to(dtype)
        decoded = torch.empty(2, 3, 21, width, dtype=dtype)
        decoded[..., 16:, :] = waiting  # the keys waiting follow the stored groups in the tensor attention reads
        codec.decode_into(decoded[..., :16, :], packed)
        tolerance = 2 * torch.finfo(dtype).eps * expected.abs().amax(-2, keepdim=True)
        assert ((decoded[..., :16, :].float() - expected).abs() <= tolerance).all()
        assert torch.equal(decoded[..., 16:, :], waiting)  # the tokens that follow, untouched
        assert not decoded[1, 2, 8:16].any()
        assert not codec.decode(torch.zeros_like(packed), dtype, width).any()  # a row joining a batch
    # why per channel: the outlying channels take a token's 16 levels, not the rest's
    states = outlying_keys(2, 3, 16, 64)
    error = (codec.decode(codec.encode(states), torch.float32, 64) - states)[..., 2:].abs().mean()
    by_token = (KVCodec(4).decode(KVCodec(4).encode(states), torch.float32, 64) - states)[..., 2:].abs().mean()
    assert error < by_token / 4, (error, by_token)


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


def round_trip(states: torch.Tensor, bits: int) -> torch.Tensor:
    return reference_round_trip(states, bits).to(states.dtype)


@pytest.mark.parametrize("kv_offload", [0.0, 1.0])
def test_a_layer_reads_its_stored_groups_and_its_waiting_keys_as_the_plain_reference(kv_offload, small_key_groups):
    """4-bit K/V through a cache layer (on the device, in host memory), fed 1 to 5 tokens at a time:
    what attention reads each time is the stored groups of keys per channel (made from the waiting
    keys' 8 bits), then the keys not yet in a stored group (this update's among them) at 8 bits, and
    every value at 4 bits token by token. Keys with no waiting (every token packed as it comes) or
    scaled token by token would read otherwise. A crop into a stored group sets its kept keys waiting again."""
    cache = PartialOffloadCache(tiny_config("llama", layers=2), kv_offload, resolve("cpu"), bits=4)
    layer = cache.layers[0]
    assert isinstance(layer, QuantizedHostLayer) == (kv_offload > 0)
    torch.manual_seed(0)
    keys, values = torch.empty(2, 2, 0, 16), torch.empty(2, 2, 0, 16)
    for new in (3, 1, 2, 5, 1, 3):  # groups filled within an update, by one, across two
        stored = keys.shape[-2] // KEY_GROUP * KEY_GROUP  # the groups full before this update
        new_keys, new_values = outlying_keys(2, 2, new, 16), torch.randn(2, 2, new, 16)
        read_keys, read_values = cache.update(new_keys, new_values, 0)
        keys, values = torch.cat([keys, new_keys], dim=-2), torch.cat([values, new_values], dim=-2)
        waiting = round_trip(keys, 8)
        expected_keys = torch.cat([reference_key_groups(waiting[..., :stored, :], KEY_GROUP),
                                   waiting[..., stored:, :]], dim=-2)
        assert torch.allclose(read_keys, expected_keys, rtol=0, atol=1e-4), (read_keys - expected_keys).abs().max()
        assert torch.allclose(read_values, round_trip(values, 4), rtol=0, atol=1e-5)
        assert cache.get_seq_length(0) == keys.shape[-2]
    # 15 tokens: 3 groups stored, 3 keys waiting (at 8 bits: a row of 16 codes and a scale)
    assert layer.keys.shape == (2, 2, 12, kv_key_row_bytes(16, torch.float32, 4))
    assert layer.recent[0].shape == (2, 2, 3, kv_row_bytes(16, torch.float32, 8))
    layer.crop(-5)  # 10 tokens: the third group cut, its first two keys waiting again
    decoded = reference_key_groups(round_trip(keys[..., :12, :], 8), KEY_GROUP)
    expected_keys = torch.cat([decoded[..., :8, :], round_trip(decoded[..., 8:10, :], 8)], dim=-2)
    read_keys, read_values = layer.states()
    assert torch.allclose(read_keys, expected_keys, rtol=0, atol=1e-4)
    assert torch.allclose(read_values, round_trip(values[..., :10, :], 4), rtol=0, atol=1e-5)
    assert cache.get_seq_length(0) == 10 and layer.keys.shape[-2] == 8


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
                                                                               make_layout, small_key_groups):
    expected = quantized_reference(make_source(arch, layers=4), bits)
    with zerolite.load(make_layout(arch, layers=4), device="cpu", offload="nvme", cpu_memory=0, kv_offload=kv_offload,
                       kv_bits=bits, show_progress=False) as lm:
        assert_same(expected, greedy(lm, ROWS, NEW_TOKENS, logits=True))
        cache = lm.new_cache()
        greedy(lm, ROWS, 2, cache=cache)
        assert_packed(cache, host=kv_offload > 0)


def test_quantized_kv_in_host_memory_on_the_simulated_device_equals_transformers(make_source, make_layout,
                                                                                 small_key_groups):
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
    per_head = kv_key_row_bytes(16, torch.bfloat16, 4) + kv_row_bytes(16, torch.bfloat16, 4)
    assert kv_bytes_per_token(config, torch.bfloat16, 4) == 2 * 2 * per_head


def test_the_memory_model_counts_what_the_quantized_cache_holds(make_layout, monkeypatch, small_key_groups):
    """Per token and layer, the bytes the cache's tensors take are kv_bytes_per_token's at each bits,
    and at 4 bits each key waiting for its group kv_waiting_bytes' share more; and --batch-size auto
    fits about 2x and 3.5x the sequences of 16-bit K/V at long contexts."""
    with zerolite.load(make_layout("llama", layers=4), device="cpu", offload="cpu", show_progress=False) as lm:
        tokens = len(ROWS[0]) + 3  # the last token chosen is not fed
        for bits in (16, 8, 4):
            cache = PartialOffloadCache(lm.config, 0.5, resolve("cpu"), bits=bits)
            greedy(lm, ROWS, 4, exact=True, cache=cache)
            held = sum(layer.keys.nbytes + layer.values.nbytes
                       + sum(rows.nbytes for rows in getattr(layer, "recent", None) or ()) for layer in cache.layers)
            waiting = tokens % KEY_GROUP if bits == 4 else 0
            expected = (tokens * kv_bytes_per_token(lm.config, lm.model.dtype, bits)
                        + waiting * kv_waiting_bytes(lm.config, lm.model.dtype, bits) // (KEY_GROUP - 1))
            assert held == len(ROWS) * expected
    # a shape whose K/V dominates (128-wide heads, many layers), in 100 GB of host memory, at 8k tokens
    monkeypatch.setattr(memory_model, "KV_KEY_TOKENS", 128)
    config = tiny_config("llama", layers=64, num_attention_heads=1, num_key_value_heads=1, head_dim=128)
    monkeypatch.setattr(batching, "host_room", lambda: 100 * 10**9)
    batches = {}
    for bits in (16, 8, 4):
        lm = SimpleNamespace(model=SimpleNamespace(config=config, dtype=torch.bfloat16), device=resolve("cpu"),
                             policy=Policy(device="cpu", kv_bits=bits))
        batches[bits] = batching.largest_batch(lm, [4] * 4096, 8000)
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



@pytest.mark.parametrize("tier", ["host", "host attended", "disk"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_running_batch_moves_packed_rows_as_it_moves_states(bits, tier, small_key_groups, tmp_path):
    """A row joining (zero rows), columns reordered in place, a row and a column leaving: done to
    the packed rows (on the device and in the tier: host memory, attended there, on disk), they
    decode to what the same changes make of the decoded states; where keys are stored in groups of
    tokens (4 bits), done to the states decoded, packed anew from them. (Whole runs of the running
    batch do not compare token for token with generate: a batch's matmuls round differently, which at 8 or 4
    bits can tip a code.)"""
    from transformers import DynamicCache

    from zerolite.decoding.running_batch import RunningBatch

    config = tiny_config("llama", layers=2)
    cpu = resolve("cpu")
    if tier == "disk":
        quantized = PartialOffloadCache(config, 0.0, cpu, bits=bits, disk=KVDisk(tmp_path, IoEngine(), cpu),
                                        disk_fraction=0.5)
    else:
        caches = (HostAttendingCaches if tier == "host attended" else OffloadedCaches)(cpu)
        quantized = caches.new(config, 0.5, bits=bits)
    plain = DynamicCache(config=config)
    torch.manual_seed(0)
    for index in range(2):
        keys, values = outlying_keys(3, 2, 6, 16), torch.randn(3, 2, 6, 16)  # 6 tokens: a group stored, 2 waiting
        plain.update(*quantized.update(keys, values, index), index)
    batches = []
    for cache in (quantized, plain):
        batch = RunningBatch.__new__(RunningBatch)
        batch.cache = cache
        batches.append(batch)
    def joined(states):
        return torch.cat([states, states.new_zeros((1, *states.shape[1:]))])

    def left(states):
        return states.index_select(0, torch.tensor([0, 2, 3]))[:, :, 1:]

    changes = [lambda batch: batch._each_layer(joined), lambda batch: batch._close_holes(4, 2, [2, 1, 2, 1]),
               lambda batch: batch._each_layer(left)]
    kind = {"host": QuantizedHostLayer, "host attended": QuantizedHostAttendedLayer, "disk": QuantizedDiskLayer}[tier]
    assert [type(layer) for layer in quantized.layers] == [QuantizedDeviceLayer, kind]
    for change in changes:
        for batch in batches:
            change(batch)
        for packed, states in zip(quantized.layers, plain.layers):
            assert packed.keys.dtype == torch.uint8
            keys, values = packed.states()
            if bits == 8:
                assert torch.equal(keys, states.keys) and torch.equal(values, states.values)
                continue
            # packed anew from the changed states: whole groups' keys per channel, the rest waiting at 8 bits
            full = states.keys.shape[-2] // KEY_GROUP * KEY_GROUP
            expected = torch.cat([reference_key_groups(states.keys[..., :full, :], KEY_GROUP),
                                  round_trip(states.keys[..., full:, :], 8)], dim=-2)
            assert torch.allclose(keys, expected, rtol=0, atol=1e-4), (keys - expected).abs().max()
            assert torch.allclose(values, round_trip(states.values, 4), rtol=0, atol=1e-5)
            states.keys, states.values = keys, values  # the next change starts from what the cache holds
    assert quantized.get_seq_length() == 5 and plain.layers[0].keys.shape[:3] == (3, 2, 5)
