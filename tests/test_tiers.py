"""Memory tiers, the printed plan, and --batch-size auto."""

from __future__ import annotations

import json
from collections import namedtuple
from functools import partial

import psutil
import pytest
import torch

import zerolite
from support.cli_runner import run
from support.helpers import greedy
from zerolite.errors import ZeroliteError
from zerolite.io.device import CpuDevice
from zerolite.layout.folder import Layout
from zerolite.runtime.budget import Budgets
from zerolite.runtime.plan import Plan, spread
from zerolite.runtime.policy import Policy, parse_size

LAYERS = 8


@pytest.fixture(scope="module")
def layout(make_layout):
    return make_layout(layers=LAYERS)


def layer_bytes(layout) -> list[int]:
    return [b.length for b in Layout.open(layout).manifest.blocks if b.name.startswith("layers.")]


def test_spread_picks_evenly_spaced_items():
    items = list(range(16))
    assert spread(items, 8) == [1, 3, 5, 7, 9, 11, 13, 15]
    assert spread(items, 4) == [2, 6, 10, 14]
    assert spread(items, 16) == items and spread(items, 99) == items
    assert spread(items, 0) == [] and spread(items, -3) == []


def test_budgets_place_layers_on_the_device_then_in_memory_then_on_disk(layout):
    manifest = Layout.open(layout).manifest
    size = max(layer_bytes(layout))
    always = sum(b.length for b in manifest.blocks if not b.name.startswith("layers."))
    budgets = Budgets(device=always + 2 * size, host=3 * size)
    plan = Plan.make(manifest, Policy(offload="nvme", device="cpu"), budgets, separate_memory=True)
    # On a GPU the resident layers go between streamed ones, so that the copy engine has one to
    # fetch while they compute; the disk's layers are one stretch after the held ones, read in order.
    assert set(plan.resident) == {"embed", "head", "layers.1", "layers.5"}
    assert plan.in_memory == ("layers.0", "layers.2", "layers.3")
    assert plan.on_disk == ("layers.4", "layers.6", "layers.7")
    assert plan.loaded == plan.resident + plan.in_memory
    # Computing from host memory, the disk's layers go between the held ones: the disk reads on while they compute.
    on_a_cpu = Plan.make(manifest, Policy(offload="nvme", device="cpu"), budgets)
    assert set(on_a_cpu.resident) == {"embed", "head", "layers.0", "layers.1"}
    assert on_a_cpu.on_disk == ("layers.3", "layers.5", "layers.7")
    assert on_a_cpu.in_memory == ("layers.2", "layers.4", "layers.6")

    everything_streams = Plan.make(manifest, Policy(offload="nvme", device="cpu"), Budgets(device=0, host=0))
    assert everything_streams.on_disk == everything_streams.streamed == tuple(f"layers.{i}" for i in range(LAYERS))
    in_memory = Plan.make(manifest, Policy(offload="cpu", device="cpu"), Budgets(device=0, host=0))
    assert in_memory.on_disk == () and len(in_memory.in_memory) == LAYERS  # --offload cpu: the host budget is not asked
    resident = Plan.make(manifest, Policy(offload="none", device="cpu"), Budgets(device=0, host=0))
    assert resident.streamed == () and len(resident.resident) == len(manifest.blocks)


def test_a_budget_holding_half_the_layers_streams_only_the_other_half(layout):
    half = sum(layer_bytes(layout)) // 2
    ids = torch.tensor([[5, 17, 33, 9]])
    read = {}
    for budget in (0, half):
        with zerolite.load(layout, offload="nvme", cpu_memory=budget, device="cpu", prefetch_depth=1,
                           show_progress=False) as lm:  # depth 1: nothing read ahead for a forward that never comes
            before = lm.bytes_read
            out = greedy(lm, ids, 5, exact=True)
            read[budget] = (lm.bytes_read - before, out)
    forwards = 5
    assert read[0][0] == forwards * sum(layer_bytes(layout))
    assert read[half][0] == forwards * half
    assert torch.equal(read[0][1], read[half][1])


def test_default_budgets_keep_what_fits_in_free_memory(layout, monkeypatch):
    """Without --cpu-memory, layers stay in host memory while what is free (less headroom) holds them."""
    manifest = Layout.open(layout).manifest
    memory = namedtuple("memory", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=64 << 30, total=64 << 30))
    roomy = Plan.make(manifest, Policy(device="cpu"), Budgets.make(manifest, Policy(device="cpu"), CpuDevice()))
    assert roomy.on_disk == ()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=1 << 30, total=1 << 30))
    tight = Plan.make(manifest, Policy(device="cpu"), Budgets.make(manifest, Policy(device="cpu"), CpuDevice()))
    assert len(tight.on_disk) == LAYERS  # less than the 2 GiB reserve is free: everything streams


@pytest.mark.parametrize(("text", "expected"),
                         [("0", 0), ("24GB", 24 * 10**9), ("1.5GiB", 3 << 29), ("512 mb", 512 * 10**6)])
def test_sizes_parse(text, expected):
    assert parse_size(text, "--cpu-memory") == expected


@pytest.mark.parametrize("text", ["20", "lots", "-1GB", "3 parsecs", ""])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ZeroliteError, match="`cpu_memory`"):
        parse_size(text, "`cpu_memory`")


def test_the_plan_is_printed_before_the_run(capsys, monkeypatch, tmp_path, layout):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "input_ids": [5 + i, 9, 12]}) + "\n" for i in range(5)))
    half = sum(layer_bytes(layout)) // 2
    result = run(capsys, monkeypatch, "generate", "--model", layout, "--device", "cpu", "--input", prompts,
                 "--cpu-memory", str(half) + "B", "--kv-offload", "0.5", "--batch-size", "auto", "--max-new-tokens",
                 "4")
    assert result.code == 0, result.stderr
    lines = result.stderr.splitlines()
    plan = next(line for line in lines if line.startswith("plan: "))
    assert "2 blocks resident on cpu" in plan and "4 layers in host memory" in plan and "layers 0, 2, 4, 6" in plan
    assert "4 layers streamed from disk" in plan and "layers 1, 3, 5, 7" in plan  # between the held ones (Plan.make)
    assert any(line.startswith("K/V cache: 4 of 8 layers in host memory") for line in lines)
    assert any(line.startswith("bound: reading") and "GB/s loading read" in line for line in lines)
    assert "batch size: 5 (auto" in result.stderr  # five prompts: the whole input in one pass
    assert len(result.stdout.splitlines()) == 5


def test_batch_size_auto_fills_the_memory_left(layout, monkeypatch):
    from zerolite.runtime.batching import largest_batch

    with zerolite.load(layout, offload="nvme", cpu_memory=0, device="cpu", show_progress=False) as lm:
        memory = namedtuple("memory", "available total")
        per_sequence = None
        for available, expected in ((10 << 30, 1000), (1 << 20, None)):
            monkeypatch.setattr(psutil, "virtual_memory", partial(memory, available=available, total=available))
            if expected is None:
                with pytest.raises(ZeroliteError, match="not even one sequence"):
                    largest_batch(lm, [2000], max_new_tokens=1000)
                continue
            assert largest_batch(lm, [8] * expected, max_new_tokens=16) == expected  # capped by the prompts
            per_sequence = per_sequence or largest_batch(lm, [8] * 10**6, max_new_tokens=16)
        assert 1000 < per_sequence <= 4096


def test_kv_offload_keeps_the_chosen_layers_in_growing_host_buffers(layout):
    from zerolite.runtime.kv_cache import MIN_TOKENS, HostLayer, PartialOffloadCache

    with zerolite.load(layout, offload="none", device="cpu", show_progress=False) as lm:
        cache = PartialOffloadCache(lm.config, 0.5, lm.device)
        assert cache.offloaded == [1, 3, 5, 7]
        ids = torch.tensor([[5, 17, 33, 9]])
        greedy(lm, ids, 6, exact=True, cache=cache)
    for i in cache.offloaded:
        layer = cache.layers[i]
        assert isinstance(layer, HostLayer) and layer.keys.device.type == "cpu"
        assert layer.get_seq_length() == cache.layers[0].get_seq_length() == 4 + 5  # the last token is never fed back
        buffer = layer._buffers[0]
        # sequence-first, appended in place
        assert buffer.shape[0] == MIN_TOKENS and layer.keys.data_ptr() == buffer.data_ptr()


def test_read_ahead_skips_blocks_that_need_no_transfer():
    from zerolite.runtime.schedule import Schedule

    schedule = Schedule(["layers.0", "layers.1", "layers.2", "layers.3"])
    on_disk = frozenset({"layers.2", "layers.3"})
    # read on through layers.1, held in memory
    assert schedule.ahead("layers.0", 2, on_disk) == ["layers.2", "layers.3"]
    assert schedule.ahead("layers.3", 2, on_disk) == ["layers.2"]  # wraps into the next forward, never itself
    assert schedule.ahead("layers.0", 2) == ["layers.1", "layers.2"]


def test_kv_offload_survives_beam_search_reordering(layout):
    from zerolite.runtime.kv_cache import PartialOffloadCache

    ids = torch.tensor([[5, 17, 33, 9], [7, 3, 11, 2]])
    with zerolite.load(layout, offload="none", device="cpu", show_progress=False) as lm:
        beams = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
        expected = lm.generate(input_ids=ids, **beams)
        got = lm.generate(input_ids=ids, cache=PartialOffloadCache(lm.config, 0.5, lm.device), **beams)
    assert torch.equal(expected, got)


def test_sliding_window_layers_keep_their_cache_on_the_device():
    from transformers import MistralConfig

    from zerolite.runtime.kv_cache import offloaded_share

    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=4096)
    assert offloaded_share(config, 1.0) == 0.0  # every layer slides: nothing is offloaded, and the plan says so
    assert offloaded_share(MistralConfig(num_hidden_layers=4, sliding_window=None), 0.5) == 0.5

