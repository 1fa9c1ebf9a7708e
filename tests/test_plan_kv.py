"""The planner's K/V tiers and bits, attention over off-GPU K/V on the CPU, micro-batches per weight
pass, a described GPU's memory bandwidth and context: the arithmetic by hand on small configs, the
search making room with them, and FlexGen's three T4 settings planned from machine flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig, OPTConfig

from support.cli_runner import run
from zerolite.memory_model import prefill_activation_bytes
from zerolite.planner.cost import Candidate, Job, predict
from zerolite.planner.hardware import CUDA_CONTEXT_BYTES, RUNTIME_BYTES, Hardware
from zerolite.planner.model_costs import ModelCosts
from zerolite.planner.search import Pins, search

CODEC = {bits: {"decode_s": 1e-9, "encode_s": 1e-4} for bits in (8, 4)}
ROWS = (1, 4, 16, 64, 256, 1024)


def cpu_machine(**overrides) -> Hardware:
    """A CPU whose matmuls take 1 ps a weight and whose attention streams K/V at 2 TB/s (so that
    the K/V's reads are visible only where meant), and whose codec takes 1 ns an element."""
    figures = dict(gpu=False, gpu_ram=0, host_ram=64 << 30, disk_gbps=2.0, fill_gbps=2.0, h2d_gbps=None,
                   gpu_tflops=None, compute={w: {r: 1e-12 for r in ROWS} for w in ("stored", "int8", "int4")},
                   kv_codec=CODEC, attention_gbps=2000.0)
    return Hardware(**{**figures, **overrides})


def gpu_machine(**overrides) -> Hardware:
    figures = dict(gpu=True, gpu_ram=16 << 30, host_ram=200 << 30, disk_gbps=2.0, fill_gbps=2.0, h2d_gbps=10.0,
                   gpu_tflops=50.0, gpu_gbps=300.0, cpu_gbps=20.0, cpu_tflops=1.0)
    return Hardware(**{**figures, **overrides})


def llama(layers=4, heads=8, kv_heads=8) -> ModelCosts:
    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=1000)
    return ModelCosts.from_config(config, torch.bfloat16, "llama")


def test_k_v_on_disk_is_read_beside_the_weights_each_step():
    costs, machine, job = llama(), cpu_machine(), Job(100, 20)
    held = Candidate("stored", 8, host_layers=4)
    on_disk = predict(costs, machine, dataclasses.replace(held, kv_disk=0.5), job)
    packed = 8 * (100 + 10) * costs.kv_bytes(16)   # a decode step's context: the prompt and half the new tokens
    appended = 8 * costs.kv_bytes(16)
    assert on_disk.disk_s == pytest.approx(0.5 * (packed + appended) / 2e9)
    in_memory = predict(costs, machine, held, job)
    assert in_memory.disk_s == 0
    # half the K/V out of memory (two layers' read ahead in its place)
    whole = 8 * 120 * costs.kv_bytes(16)
    assert in_memory.host_bytes - on_disk.host_bytes == pytest.approx(0.5 * whole - 2 * whole / 4, abs=1)


@pytest.mark.parametrize("bits", [8, 4])
def test_k_v_bits_shrink_its_bytes_and_pay_the_codec(bits):
    costs, machine, job = llama(), cpu_machine(), Job(100, 20)
    full, small = (predict(costs, machine, Candidate("stored", 8, 4, kv_bits=b), job) for b in (16, bits))
    whole = 8 * 120
    decoded = whole * costs.kv_bytes(16) / 4   # one layer's K/V dequantised while attention reads it
    assert full.host_bytes - small.host_bytes == pytest.approx(
        whole * (costs.kv_bytes(16) - costs.kv_bytes(bits)) - decoded, abs=1)
    itemsize, context = 2, 8 * 110
    codec = context * costs.kv_bytes(16) / itemsize * 1e-9 + 2 * 4 * 1e-4   # dequantised, and 2 appends a layer
    reads = context * 2 * (costs.kv_bytes(16) - costs.kv_bytes(bits)) / (itemsize / 1e-12)  # 2 P + D, at 2 TB/s
    assert small.compute_s - full.compute_s == pytest.approx(codec - reads, rel=1e-6)


def test_attention_on_the_cpu_sends_no_k_v_over_the_link():
    costs, machine, job = llama(), gpu_machine(), Job(1000, 32)
    offloaded = Candidate("stored", 64, host_layers=4, kv_offload=1.0)
    device, cpu = (predict(costs, machine, dataclasses.replace(offloaded, kv_attention=a), job)
                   for a in ("device", "cpu"))
    context, weights = 64 * 1016, 4 * costs.formats["stored"].layer_bytes / 10e9
    assert device.copy_s == pytest.approx(weights + context * costs.kv_bytes(16) / 10e9, rel=1e-6)
    queries = 4 * 2 * 64 * 512 * 2 / 10e9   # a layer's query out and output back
    assert cpu.copy_s == pytest.approx(weights + queries, rel=1e-6) and device.cpu_s == 0
    assert cpu.cpu_s == pytest.approx(3 * context * costs.kv_bytes(16) / 20e9 + 4 * 50e-6, rel=1e-6)
    # the GPU no longer holds the two layers' K/V it copied in
    assert device.gpu_bytes - cpu.gpu_bytes == pytest.approx(2 * 64 * 1032 * costs.kv_bytes(16) / 4, abs=1)


def test_micro_batches_hold_one_micro_batchs_activations_and_split_its_work():
    costs, machine, job = llama(), gpu_machine(), Job(512, 8)
    one, four = (predict(costs, machine, Candidate("stored", 64, 4, micro_batches=n), job) for n in (1, 4))
    assert one.gpu_bytes - four.gpu_bytes == 48 * prefill_activation_bytes(costs.shape, 512, torch.bfloat16)
    assert four.compute_s > one.compute_s and four.copy_s == one.copy_s


def test_the_search_makes_room_with_micro_batches_k_v_off_the_gpu_and_fewer_bits():
    """A batch whose prefill activations and K/V do not fit a small GPU runs in micro-batches with
    its K/V off the GPU; a host too small for its K/V puts it on disk or keeps it at fewer bits."""
    costs, job = llama(layers=16), Job(2048, 16)
    per_sequence = prefill_activation_bytes(costs.shape, 2048, torch.bfloat16)
    kv = 128 * 2064 * costs.kv_bytes(16)
    machine = gpu_machine(gpu_ram=int(0.5 * kv + 8 * per_sequence))
    chosen = search(costs, machine, job, Pins(batch_size=128, weights="stored", kv_bits=16)).best.candidate
    assert chosen.micro_batches >= 8 and chosen.kv_offload + chosen.kv_disk > 0
    with pytest.raises(Exception, match="no policy the given flags allow fits"):
        search(costs, machine, job, Pins(batch_size=128, weights="stored", kv_bits=16, micro_batches=1))
    small_host = gpu_machine(gpu_ram=int(0.3 * kv + 8 * per_sequence), host_ram=int(RUNTIME_BYTES + 0.1e9 + 0.3 * kv))
    on_disk = search(costs, small_host, job, Pins(batch_size=128, weights="stored", kv_bits=16)).best.candidate
    assert on_disk.kv_disk > 0
    fewer_bits = search(costs, small_host, job, Pins(batch_size=128, weights="stored", kv_disk=0.0)).best.candidate
    assert fewer_bits.kv_bits < 16 and fewer_bits.kv_disk == 0


def test_a_described_gpu_waits_on_its_memory_at_small_batches_and_loses_its_context():
    costs, job = llama(), Job(16, 8)
    fast, slow = (predict(costs, gpu_machine(gpu_gbps=g), Candidate("stored", 1, 0, gpu_layers=4), job)
                  for g in (1e6, 1.0))
    assert slow.compute_s - fast.compute_s >= 4 * costs.dense_weights * 2 / 1e9 * 0.99
    described = gpu_machine().with_flags(gpu_ram=16 << 30)
    assert described.gpu_context == CUDA_CONTEXT_BYTES
    int4 = predict(costs, described, Candidate("int4", 1, 4), job)
    assert int4.gpu_bytes - predict(costs, gpu_machine(), Candidate("int4", 1, 4), job).gpu_bytes == CUDA_CONTEXT_BYTES


# FlexGen's T4 machine (Sheng et al., 2023): a 16 GB T4 (65 fp16 TFLOPS, 320 GB/s), 208 GB of RAM, a
# 1.5 TB NVMe (about 2 GB/s); the link and the CPU's attention rate as FlexGen's cost model calibrated
# them on that machine (12.89 GiB/s; 0.0123 TFLOPS, about 12 GB/s of K/V at a FLOP a byte).
T4 = ["--gpu-ram", "16GB", "--host-ram", "208GB", "--disk-gbps", "2GB/s", "--h2d-gbps", "12.89GiB/s",
      "--gpu-tflops", "65TFLOPS", "--gpu-gbps", "320GB/s", "--cpu-gbps", "12GB/s", "--cpu-tflops", "1TFLOPS",
      "--prompt-tokens", "512", "--new-tokens", "32", "--prefetch-depth", "2"]
FLEXGEN = {  # the three settings of its Table 2, each a model and the flags that pin the setting
    "opt-30b, K/V on the CPU": (
        "opt-30b", ["--batch-size", "144", "--weights", "stored", "--kv-bits", "16", "--kv-offload", "1"]),
    "opt-175b, weights half on disk, K/V on disk": (
        "opt-175b", ["--batch-size", "256", "--weights", "stored", "--kv-bits", "16", "--cpu-memory", "175GB",
                     "--gpu-memory", "0", "--kv-disk", "1"]),
    "opt-175b, 4-bit weights and K/V": ("opt-175b", ["--batch-size", "144", "--weights", "int4", "--kv-bits", "4"]),
}


def test_flexgens_three_t4_settings_are_planned_from_machine_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    configs, planned = {}, {}
    for name, hidden, layers in (("opt-30b", 7168, 48), ("opt-175b", 12288, 96)):
        configs[name] = OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                  ffn_dim=4 * hidden, word_embed_proj_dim=hidden, vocab_size=50272, dtype="float16")
        configs[name].save_pretrained(tmp_path / name)
    for setting, (model, flags) in FLEXGEN.items():
        result = run(capsys, monkeypatch, "plan", "--json", "--model", tmp_path / model, *T4, *flags)
        assert result.code == 0, (setting, result.stderr)
        planned[setting] = json.loads(result.stdout)
    thirty, disk, four = planned.values()
    assert (thirty["batch_size"], thirty["kv_offload"], thirty["kv_bits"]) == (144, 1.0, 16)
    assert (disk["batch_size"], disk["kv_disk"], disk["host_layers"], disk["disk_layers"]) == (256, 1.0, 48, 48)
    # disk-bound: half the layers and the K/V at a step's mean context (and the new token's) over 2 GB/s
    costs = ModelCosts.from_config(configs["opt-175b"], torch.float16)
    kv = costs.kv_bytes(16) * 256 * (512 + 16 + 1)
    assert disk["bottleneck"] == "disk"
    assert disk["decode_step_s"] == pytest.approx((48 * costs.formats["stored"].layer_bytes + kv) / 2e9, rel=1e-6)
    assert (four["weights"], four["kv_bits"], four["batch_size"]) == ("int4", 4, 144)
    for p in planned.values():  # each prefill in micro-batches: a batch of 512-token prompts is far past 16 GB
        assert p["micro_batches"] > 1 and p["gpu_bytes"] <= 16e9 and p["tokens_per_s"] > 0
        assert "--micro-batches" in p["command"]
