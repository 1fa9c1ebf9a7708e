"""Attention over K/V in host memory computed on the host (`kv_attention` cpu): generation equal to
transformers' token for token on the CPU and on the simulated device, the link carrying none of
those layers' K/V (counted copy by copy), compute waiting for the host's output, quantized K/V
with the device tier's codecs (at 4 bits keys grouped per channel, the group filling waiting on the
host) decoded on the host, beside layers on disk and on the device, and families whose attention
can't go there left on the device with one line."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerolite
from support.helpers import greedy, new_tokens_alone
from support.simulated_device import OrderingError, SimulatedDevice
from support.tiny_models import tiny_config
from test_kv_bits import KEY_GROUP
from test_running_batch import prompts, staggered
from zerolite import memory_model
from zerolite.cli.plan_summary import summarize
from zerolite.hf import build_meta_model
from zerolite.io.device import resolve
from zerolite.runtime.host_attention import HostAttendedLayer, QuantizedHostAttendedLayer, host_attending_caches, unfit
from zerolite.runtime.kv_cache import HostLayer, PartialOffloadCache, QuantizedDiskLayer

ROWS = [[5, 17, 33, 9, 44, 61, 70], [12, 90]]  # one batch: the short prompt left-padded
NEW_TOKENS = 5
LAYERS = 4


def reference(source, bits: int = 16):
    """transformers' greedy generation in RAM (at bits < 16 with zerolite's quantized cache on the device passed in)."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    more = {"cache": PartialOffloadCache(model.config, 0.0, resolve("cpu"), bits=bits)} if bits < 16 else {}
    return greedy(model, ROWS, NEW_TOKENS, logits=True, **more)


def assert_same(expected, got) -> None:
    assert torch.equal(expected.sequences, got.sequences.cpu())
    for e, g in zip(expected.logits, got.logits, strict=True):
        assert torch.equal(e, g.cpu()), (e - g.cpu()).abs().max()


def kv_fetched(sim: SimulatedDevice, cache, counted: list) -> None:
    """Records in counted the bytes of every copy that reads a host layer's K/V buffers."""
    copy = sim.copy

    def recorded(dst, src, stream):
        buffers = {flat.untyped_storage().data_ptr() for layer in cache.layers
                   if isinstance(layer, HostLayer) and layer._pinned is not None for flat in layer._pinned}
        if src.untyped_storage().data_ptr() in buffers:
            counted.append(src.nbytes)
        copy(dst, src, stream)

    sim.copy = recorded


# llama: grouped-query attention (4 heads, 2 K/V heads) under sdpa; gemma2: eager attention with
# soft-capping, sliding-window layers (on the device) between full ones; gpt_oss: eager attention
# with its sinks (a parameter of the attention module itself) and a mixture's experts
@pytest.mark.parametrize(("where", "arch"), [("cpu", "llama"), ("sim", "llama"), ("sim", "gemma2"), ("sim", "gpt_oss")])
def test_attention_on_the_host_equals_transformers(where, arch, make_source, make_layout):
    expected = reference(make_source(arch, layers=LAYERS))
    sim = SimulatedDevice(seed=5, max_delay_s=5e-4) if where == "sim" else None
    with (sim.watching() if sim else contextlib.nullcontext()), \
            zerolite.load(make_layout(arch, layers=LAYERS), device=sim or "cpu", offload="nvme", cpu_memory=0,
                          gpu_memory=0, kv_offload=1.0, kv_attention="cpu", show_progress=False) as lm:
        got = greedy(lm, ROWS, NEW_TOKENS, logits=True)
        assert_same(expected, got)
        attended = lm.new_cache()
        assert any(isinstance(layer, HostAttendedLayer) for layer in attended.layers)
        # every full-attention layer's attention computed on the host at every step (prefill and decodes)
        assert lm.parts.caches.staging.calls == NEW_TOKENS * len(
            [layer for layer in attended.layers if isinstance(layer, HostAttendedLayer)])


@pytest.mark.parametrize("kv_attention", ["device", "cpu"])
def test_the_link_carries_no_kv_of_layers_attended_on_the_host(kv_attention, make_source, make_layout):
    """On the simulated device, half the layers' K/V in host memory: attended on the device, every
    step copies their K/V over; attended on the host, no copy reads their buffers (the new tokens
    go the other way, into them), and the tokens are transformers' either way."""
    expected = reference(make_source("llama", layers=LAYERS))
    sim = SimulatedDevice(seed=3, max_delay_s=5e-4)
    counted = []
    with sim.watching(), zerolite.load(make_layout("llama", layers=LAYERS), device=sim, offload="nvme", cpu_memory=0,
                                       gpu_memory=0, kv_offload=0.5, kv_attention=kv_attention,
                                       show_progress=False) as lm:
        cache = lm.new_cache()
        kv_fetched(sim, cache, counted)
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS, cache=cache), expected.sequences)
        host = [layer for layer in cache.layers if isinstance(layer, HostLayer)]
        assert len(host) == LAYERS // 2
        assert all(isinstance(layer, HostAttendedLayer) for layer in host) == (kv_attention == "cpu")
        said = [line for line in summarize(lm) if line.startswith("K/V cache: ")]
        assert ("attended there by the CPU" in said[0]) == (kv_attention == "cpu"), said
    assert (sum(counted) == 0) == (kv_attention == "cpu"), counted


def test_without_the_wait_for_the_hosts_output_the_device_reads_it_early(make_layout):
    """The device's use of the attention output the host computed waits for its copy back: without
    that wait the simulated device's ledger sees compute read it before the copy that fills it."""
    sim = SimulatedDevice(seed=7, max_delay_s=2e-3)
    with pytest.raises(OrderingError, match="compute reads a device buffer before the copy"):
        with sim.watching(), zerolite.load(make_layout("llama", layers=LAYERS), device=sim, offload="nvme",
                                           cpu_memory=0, gpu_memory=0, kv_offload=1.0, kv_attention="cpu",
                                           show_progress=False) as lm:
            outputs = lm.parts.caches.staging.stream
            sim.skipped_waits.append(lambda stream, event: stream is sim.compute and event.stream is outputs)
            greedy(lm, ROWS, 2)


def test_without_the_hosts_wait_for_the_appends_it_attends_over_stale_kv(make_source, make_layout):
    """The host reads a layer's K/V only once the step's new keys and values have landed in its
    buffers: without that wait (the appends held up a while) it attends over what was there
    before, and the tokens go wrong."""
    expected = reference(make_source("llama", layers=LAYERS))
    sim = SimulatedDevice(seed=1, max_delay_s=5e-4)
    with sim.watching(), zerolite.load(make_layout("llama", layers=LAYERS), device=sim, offload="nvme", cpu_memory=0,
                                       gpu_memory=0, kv_offload=1.0, kv_attention="cpu", show_progress=False) as lm:
        _, appends = lm.parts.caches.streams
        copy = sim.copy

        def late(dst, src, stream):
            if stream is appends:
                stream.submit(lambda: time.sleep(0.01))
            copy(dst, src, stream)

        sim.copy = late
        sim.skipped_synchronizes.append(lambda event: event.stream is appends)
        assert not torch.equal(greedy(lm, ROWS, 2), expected.sequences[:, :-(NEW_TOKENS - 2)])
        sim.skipped_synchronizes.clear()


@pytest.mark.parametrize(("where", "bits"), [("sim", 8), ("sim", 4), ("cpu", 4)])
def test_quantized_kv_is_decoded_and_attended_on_the_host(where, bits, make_source, make_layout, monkeypatch):
    """--kv-bits with the host's attention, a layer on disk and one on the device beside: only the
    new tokens' packed rows go to the host, where (at 4 bits) the keys of the group filling wait and a
    full group is packed per channel, and the K/V is decoded there; the tokens are transformers' with
    the device tier's quantized cache, the link carrying none of the host layers' K/V."""
    monkeypatch.setattr(memory_model, "KV_KEY_TOKENS", KEY_GROUP)  # groups fill and wait in these tiny runs
    expected = reference(make_source("llama", layers=LAYERS), bits)
    sim = SimulatedDevice(seed=2, max_delay_s=5e-4) if where == "sim" else None
    counted = []
    with (sim.watching() if sim else contextlib.nullcontext()), \
            zerolite.load(make_layout("llama", layers=LAYERS), device=sim or "cpu", offload="nvme", cpu_memory=0,
                          gpu_memory=0, kv_offload=0.5, kv_disk=0.25, kv_bits=bits, kv_attention="cpu",
                          show_progress=False) as lm:
        cache = lm.new_cache()
        if sim:
            kv_fetched(sim, cache, counted)
        got = greedy(lm, ROWS, NEW_TOKENS, logits=True, cache=cache)
        assert torch.equal(expected.sequences, got.sequences)
        for e, g in zip(expected.logits, got.logits, strict=True):
            assert torch.allclose(e, g, rtol=0, atol=1e-5), (e - g).abs().max()
        host = [layer for layer in cache.layers if isinstance(layer, HostAttendedLayer)]
        assert len(host) == LAYERS // 2 and all(type(layer) is QuantizedHostAttendedLayer for layer in host)
        assert [type(cache.layers[i]) for i in cache.on_disk] == [QuantizedDiskLayer]
        tokens = len(ROWS[0]) + NEW_TOKENS - 1  # the last token chosen is not fed
        stored = tokens // KEY_GROUP * KEY_GROUP if bits == 4 else tokens
        for layer in host:
            assert layer.keys.dtype == torch.uint8 and layer.keys.shape[-2] == stored
            assert layer.recent_length == tokens - stored
        assert lm.parts.caches.staging.calls == NEW_TOKENS * len(host)
        cache.wait_for_copies()
    assert not counted, counted


def test_rows_joining_and_leaving_a_running_batch_are_attended_on_the_host(make_source, make_layout):
    """The running batch (serve, generate's input files) widens, crops and reorders the host
    layers' K/V between steps; each row's tokens are still transformers' for its prompt alone."""
    model = AutoModelForCausalLM.from_pretrained(make_source("llama"), dtype=torch.float32)
    expected = [new_tokens_alone(model, p, 4, eos_token_id=None) for p in prompts(1)[:3]]
    sim = SimulatedDevice(seed=4, max_delay_s=5e-4)
    with sim.watching(), zerolite.load(make_layout("llama"), device=sim, offload="nvme", cpu_memory=0, gpu_memory=0,
                                       kv_offload=0.5, kv_attention="cpu", show_progress=False) as lm:
        got, _ = staggered(lm, prompts(1)[:3], step_tokens=8, tokens=4)
        assert lm.parts.caches.staging.calls > 0
    assert got == expected


def test_a_family_whose_attention_reworks_the_cache_s_kv_stays_on_the_device(capsys):
    """DeepSeek-V3's MLA caches a latent that kv_b_proj (weights on the device) expands before
    attention: its attention stays on the device, said in one line; families that hand the cache's
    K/V straight to attention pass the probe."""
    assert unfit(build_meta_model(tiny_config("llama"), torch.float32).config) is None
    model = build_meta_model(tiny_config("deepseek_v3"), torch.float32)
    assert host_attending_caches(model, resolve("cpu")) is None
    assert model.config._attn_implementation == "sdpa"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["zerolite: attention over K/V in host memory runs on the device: deepseek_v3's attention "
                     "does not take the K/V as the cache gives them"]

