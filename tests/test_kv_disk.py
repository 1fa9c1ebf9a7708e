"""K/V on disk (--kv-disk): generation equal token for token to transformers' generate (16 bits, and
8 and 4 bits against the same quantized cache in RAM, the device tier's: at 4 bits a group's keys
written per channel once it fills; on the CPU and the simulated device, with host and disk tiers
together), the K/V really read from its files, every byte read and written counted, the files
written in whole pages and removed at the end, the running batch's changes to a layer on disk,
--batch-size auto, the bad settings refused, and tools/bench_kv_disk's read pass."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import zerolite
from support.helpers import greedy
from support.tiny_models import tiny_config
from test_kv_bits import KEY_GROUP
from zerolite import memory_model
from zerolite.errors import ZeroliteError
from zerolite.io.device import resolve
from zerolite.io.engine import IoEngine
from zerolite.layout.folder import Layout
from zerolite.runtime import batching
from zerolite.runtime.kv_cache import PartialOffloadCache, QuantizedDiskLayer
from zerolite.runtime.kv_disk import FOLDER_PREFIX, DiskLayer, KVDisk
from zerolite.runtime.policy import Policy

ROWS = [[5, 17, 33, 9, 44, 61, 70], [12, 90]]  # one batch: the short prompt left-padded
NEW_TOKENS = 5


@pytest.fixture(autouse=True)
def small_key_groups(monkeypatch):
    """4-bit keys grouped over KEY_GROUP tokens, so that the tiny runs fill groups and leave one filling."""
    monkeypatch.setattr(memory_model, "KV_KEY_TOKENS", KEY_GROUP)


def reference(source, bits: int, device: str):
    """transformers' greedy generation in RAM (with zerolite's quantized cache on the device where bits < 16)."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()  # aligned, as zerolite's slots are (test_executor)
    more = {"cache": PartialOffloadCache(model.config, 0.0, resolve(device), bits=bits)} if bits < 16 else {}
    return greedy(model, ROWS, NEW_TOKENS, logits=True, device=device, **more)


def assert_same(expected, got) -> None:
    assert torch.equal(expected.sequences.cpu(), got.sequences.cpu())
    for e, g in zip(expected.logits, got.logits, strict=True):
        assert torch.allclose(e.cpu(), g.cpu(), rtol=0, atol=1e-5), (e.cpu() - g.cpu()).abs().max()


def kv_folders(layout) -> list:
    return sorted(layout.parent.glob(FOLDER_PREFIX + "*"))


def check_generation(source, layout, bits: int, device, **tiers) -> None:
    """Equal to transformers; the K/V files read (every step's prefix), written (at 4 bits a group of
    tokens once it fills, the group filling waiting in memory) in whole pages, each byte counted,
    and gone: each job's at its end, the folder when the model closes."""
    runs_on = device if isinstance(device, str) else "cpu"  # the simulated device computes on the CPU

    def written(fed: int) -> int:
        """The tokens in a layer's file once fed tokens were."""
        return fed // KEY_GROUP * KEY_GROUP if bits == 4 else fed

    expected = reference(source, bits, runs_on)
    with zerolite.load(layout, device=device, offload="nvme", cpu_memory=0, kv_bits=bits, show_progress=False,
                       **tiers) as lm:
        disk = lm.parts.caches.disk
        assert_same(expected, greedy(lm, ROWS, NEW_TOKENS, logits=True, device=runs_on))
        disk.wait_for_writes()
        job_read, job_written = disk.bytes_read, disk.bytes_written
        assert disk.folder.parent == layout.parent and not list(disk.folder.iterdir())  # the job's files removed
        cache = lm.new_cache()
        greedy(lm, ROWS, 3, cache=cache, device=runs_on)  # kept by the caller: its files stay until it goes
        on_disk = [cache.layers[i] for i in cache.on_disk]
        assert on_disk and all(type(layer) is (DiskLayer if bits == 16 else QuantizedDiskLayer) for layer in on_disk)
        if tiers.get("kv_offload"):
            assert cache.offloaded and not set(cache.offloaded) & set(cache.on_disk)
        files = sorted(disk.folder.iterdir())
        assert len(files) == len(on_disk)
        record = on_disk[0]._token_bytes[0] + on_disk[0]._token_bytes[1]  # a token's keys and values, both rows
        tokens = len(ROWS[0]) + 2  # the last token chosen is not fed
        assert on_disk[0].length == written(tokens) and on_disk[0].get_seq_length() == tokens
        assert os.path.getsize(files[0]) == -(-written(tokens) * record // 4096) * 4096  # whole pages
        # the first job: each decode step read what the file held, and every token stored was written once
        fed = len(ROWS[0]) + NEW_TOKENS - 1
        assert job_written == len(on_disk) * record * written(fed)
        assert job_read == len(on_disk) * record * sum(written(n) for n in range(len(ROWS[0]), fed))
        cache.wait_for_copies()  # its host layers' last appends landed, before their buffers go
        del cache, on_disk
    assert not kv_folders(layout)


@pytest.mark.parametrize(("bits", "tiers"), [(16, dict(kv_disk=1.0)), (4, dict(kv_offload=0.25, kv_disk=0.5))])
def test_cpu_generation_with_kv_on_disk_equals_transformers(bits, tiers, make_source, make_layout):
    check_generation(make_source("llama", layers=4), make_layout("llama", layers=4), bits, "cpu", **tiers)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_kv_on_disk_on_a_device_of_its_own_equals_transformers(bits, gpu, make_source, make_layout):
    """Each layer's K/V read into a pinned buffer, copied to the device on compute's stream, and
    its new tokens copied out before they are written (on the simulated device, every ordering checked)."""
    check_generation(make_source("llama", layers=4), make_layout("llama", layers=4), bits, gpu, gpu_memory=0,
                     kv_offload=0.25, kv_disk=0.5)


def test_a_layer_on_disk_takes_the_running_batch_s_changes(tmp_path):
    """Rows selected, columns cropped, a row joined by assigning keys and values: the next update
    hands attention what a DynamicCache given the same changes does, the file written anew."""
    config = tiny_config("llama", layers=2)
    disk = KVDisk(tmp_path, IoEngine(), resolve("cpu"))
    on_disk = PartialOffloadCache(config, 0.0, resolve("cpu"), disk=disk, disk_fraction=1.0)
    plain = DynamicCache(config=config)
    torch.manual_seed(0)

    def step(tokens: int, batch: int = 3) -> None:
        for index in range(2):
            keys, values = torch.randn(batch, 2, tokens, 16), torch.randn(batch, 2, tokens, 16)
            for got, want in zip(on_disk.update(keys, values, index), plain.update(keys, values, index)):
                assert torch.equal(got, want)

    step(5)
    step(1)
    for cache in (on_disk, plain):
        cache.batch_select_indices(torch.tensor([2, 0]))
        cache.crop(-2)
        for layer in cache.layers:
            layer.keys = torch.cat([layer.keys, torch.zeros_like(layer.keys[:1])])
            layer.values = torch.cat([layer.values, torch.zeros_like(layer.values[:1])])
    assert on_disk.get_seq_length() == plain.get_seq_length() == 4
    step(1)
    step(2)
    assert disk.bytes_read > 0
    on_disk.return_host_buffers()
    disk.wait_for_writes()
    assert not list(disk.folder.iterdir())
    disk.close()
    assert not disk.folder.exists()


def test_batch_size_auto_counts_only_two_layers_of_the_k_v_on_disk(monkeypatch):
    """A shape whose K/V dominates, in 10 GB of host memory: with every layer's K/V on disk the
    batch is many times the one that holds it all in memory; at 4 bits each layer's group of
    tokens not yet full is counted in memory too (64 layers' 127 tokens against 2 layers' 4004)."""
    config = tiny_config("llama", layers=64, num_attention_heads=1, num_key_value_heads=1, head_dim=128)
    monkeypatch.setattr(batching, "host_room", lambda: 10 * 10**9)
    monkeypatch.setattr(memory_model, "KV_KEY_TOKENS", 128)

    def batch(kv_disk: float, bits: int = 16) -> int:
        lm = SimpleNamespace(model=SimpleNamespace(config=config, dtype=torch.bfloat16), device=resolve("cpu"),
                             policy=Policy(device="cpu", kv_disk=kv_disk, kv_bits=bits))
        return batching.largest_batch(lm, [4] * 4096, 4000)

    assert batch(1.0) >= 8 * batch(0.0)
    four_bits = batch(1.0, 4)
    monkeypatch.setattr(batching, "kv_filling_group_bytes", lambda *shape: 0)  # what forgetting them would give
    assert four_bits < 0.75 * batch(1.0, 4)


def test_bad_kv_disk_settings_are_one_clear_error(make_layout):
    """(test_bad_input: the command line's one line.)"""
    layout = make_layout("llama", layers=4)
    with pytest.raises(ZeroliteError, match="`kv_disk` keeps K/V files under the offload root.*`offload` cpu"):
        zerolite.load(layout, device="cpu", offload="cpu", kv_disk=0.5, show_progress=False)
    with pytest.raises(ZeroliteError, match="`kv_disk` .* at most 1 together, not 0.6 with 0.5"):
        zerolite.load(layout, device="cpu", kv_offload=0.5, kv_disk=0.6, show_progress=False)


def test_the_benchmark_s_read_pass_reads_each_layer_s_weights_and_k_v(make_layout, tmp_path):
    """tools/bench_kv_disk's bound: its stand-in K/V files are whole pages of the asked size, and a
    pass reads them with every layer's block."""
    from bench_kv_disk import weights_and_kv_pass, write_kv_files

    layout = Layout.open(make_layout("llama", layers=4))
    paths = write_kv_files(tmp_path / "kv", 4, 10_000)
    assert [os.path.getsize(path) for path in paths] == [12_288] * 4
    assert weights_and_kv_pass(layout, paths, 5_000) > 0
