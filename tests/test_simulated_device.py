"""The device layer on the simulated asynchronous device: it catches every missing ordering step,
and the CUDA path's defects stay fixed (pinned memory counted, device-side waits profiled, copies
finished before their buffers go, resident blocks staged, K/V fetches ordered, ids checked, no
static cache)."""

from __future__ import annotations

import contextlib
import threading
from collections import namedtuple

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

import zerolite
import zerolite.runtime.kv_cache
import zerolite.runtime.resident
from support.helpers import greedy
from support.simulated_device import OrderingError, PageableCopyError, SimulatedDevice
from zerolite.errors import ZeroliteError
from zerolite.io.engine import aligned_empty
from zerolite.layout.folder import Layout
from zerolite.memory_model import kv_bytes_per_token
from zerolite.planner.machine import measure_host_to_device
from zerolite.profile.run import profile_run
from zerolite.runtime.batching import MARGIN, largest_batch
from zerolite.runtime.kv_cache import HostLayer, PartialOffloadCache
from zerolite.runtime.timeline import Timeline

LAYERS = 6
ROWS = [[5, 17, 33, 9, 44, 61, 70], [12, 90]]  # one batch: the short prompt left-padded
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(make_source, make_layout):
    """A tiny Llama's layout and transformers' greedy tokens on its weights in RAM."""
    model = AutoModelForCausalLM.from_pretrained(make_source("llama", layers=LAYERS), dtype=torch.float32)
    return make_layout("llama", layers=LAYERS), greedy(model, ROWS, NEW_TOKENS)


def power_of_two(nbytes: int) -> int:
    """A pinning that rounds up to a power of two, as torch's pinned caching allocator does."""
    return 1 << max(nbytes - 1, 0).bit_length()


def adopted_device(**options) -> SimulatedDevice:
    """A simulated device the calling thread has adopted, as zerolite.load makes it."""
    sim = SimulatedDevice(**options)
    sim.adopt_thread()
    return sim


def layer_bytes(layout) -> int:
    return Layout.open(layout).manifest.block("layers.0").length


# Each ordering step the runtime asks the device for, and how to take it away again: a predicate
# for the waits (stream, event) or host synchronisations (event) the device then drops. They hold
# streams, not the model: the simulated device's threads keep it, and its predicates, alive.
def copy_waits_for_compute(sim, lm):
    copies = lm.executor.slots.copy_stream
    sim.skipped_waits.append(lambda stream, event: stream is copies and event.stream is sim.compute)


def compute_waits_for_copy(sim, lm):
    copies = lm.executor.slots.copy_stream
    sim.skipped_waits.append(lambda stream, event: stream is sim.compute and event.stream is copies)


def refill_waits_for_copy(sim, lm):
    copies = lm.executor.slots.copy_stream
    sim.skipped_synchronizes.append(lambda event: event.stream is copies)


def compute_waits_for_kv_fetch(sim, lm):
    fetches, _ = lm.parts.caches.streams
    sim.skipped_waits.append(lambda stream, event: stream is sim.compute and event.stream is fetches)


def kv_fetch_waits_for_appends(sim, lm):
    fetches, appends = lm.parts.caches.streams
    sim.skipped_waits.append(lambda stream, event: stream is fetches and event.stream is appends)


REMOVALS = {
    "the copy's wait for compute's last use of the slot": (copy_waits_for_compute, {}),
    "compute's wait for the copy": (compute_waits_for_copy, {}),
    "the wait before a slot's host buffer is refilled": (refill_waits_for_copy, {}),
    "compute's wait for the K/V fetch": (compute_waits_for_kv_fetch, dict(kv_offload=1.0)),
    "the K/V fetch's wait for the last appends": (kv_fetch_waits_for_appends, dict(kv_offload=1.0)),
}


@pytest.mark.parametrize("removal", REMOVALS)
def test_the_simulated_device_catches_each_missing_ordering_step(tiny, removal):
    layout, expected = tiny
    remove, setup = REMOVALS[removal]
    caught = []
    for seed in range(3):
        sim = SimulatedDevice(seed=seed, max_delay_s=0.004)
        with zerolite.load(layout, device=sim, offload="nvme", cpu_memory=0, gpu_memory=0, show_progress=False,
                           **setup) as lm:
            remove(sim, lm)
            try:
                with sim.watching():
                    got = greedy(lm, ROWS, NEW_TOKENS)
            except OrderingError as e:
                caught.append(f"ledger: {e}")
                lm.executor.recover()
                continue
            caught.append("wrong tokens" if not torch.equal(got, expected) else None)
    assert all(caught), caught  # every seed: the ledger or the tokens


def test_without_removals_every_rule_holds_and_compute_is_ordered_after_copies_at_close(tiny):
    layout, expected = tiny
    sim = SimulatedDevice(seed=7)
    with sim.watching():
        lm = zerolite.load(layout, device=sim, offload="cpu", gpu_memory=0, show_progress=False)
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS), expected)
        lm.close()
    assert sim.compute_after_copies()


def test_without_ordering_compute_after_copies_the_teardown_race_is_caught(tiny):
    layout, _ = tiny
    sim = SimulatedDevice(seed=7)
    lm = zerolite.load(layout, device=sim, offload="cpu", gpu_memory=0, show_progress=False)
    greedy(lm, ROWS, NEW_TOKENS)  # the read-ahead wraps into the next forward: the copy of its first layer is queued
    refill_waits_for_copy(sim, lm)  # close() waits for the copy stream: taken away
    lm.close()
    assert not sim.compute_after_copies()


def test_pinned_memory_is_counted_at_what_pinning_takes(tiny, monkeypatch):
    """Pinned allocations round up (a real device to pages, 2 MiB for large ones; here, to make it
    matter for tiny layers, to a power of two): the host budget holds fewer layers than their raw
    size suggests, and what is pinned stays within the budget and the ring."""
    layout, expected = tiny
    sim = SimulatedDevice()
    sim.pinned_cost = power_of_two
    layer = layer_bytes(layout)
    cost = sim.pinned_cost(layer)
    assert cost > layer
    budget = 3 * layer
    with zerolite.load(layout, device=sim, offload="nvme", cpu_memory=budget, gpu_memory=0, show_progress=False) as lm:
        assert len(lm.plan.in_memory) == budget // cost < 3
        ring = lm.policy.prefetch_depth * cost
        assert sim.pinned <= budget + ring
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS), expected)


def test_preflight_counts_pinned_bytes_against_physical_memory(tiny, monkeypatch):
    layout, _ = tiny
    sim = SimulatedDevice()
    layer = layer_bytes(layout)
    raw_need = 3 * layer + 2 * layer          # three layers held, two ring slots, at their size
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: namedtuple("memory", "available total")(raw_need + 4096, 1 << 40))
    with pytest.raises(ZeroliteError, match="pins .* in host memory"):
        zerolite.load(layout, device=sim, offload="nvme", cpu_memory=3 * sim.pinned_cost(layer), gpu_memory=0,
                      show_progress=False)


@pytest.mark.alone
def test_the_profiler_sees_compute_waiting_for_copies_on_the_device(tiny):
    """--offload cpu with slow copies: the stall is on the device (the host only queues a wait),
    timed there, and the step is not judged compute-bound."""
    layout, _ = tiny
    sim = SimulatedDevice(max_delay_s=0.04)
    timeline = Timeline()
    with zerolite.load(layout, device=sim, offload="cpu", gpu_memory=0, timeline=timeline, show_progress=False) as lm:
        report = profile_run(lm, timeline, batch_size=1, new_tokens=4, prompt_tokens=4)
    assert report.wait_s > 0.3 * report.decode_step_s, report
    assert report.bottleneck != "compute", report.verdict
    assert all(0 <= s.start and s.end >= s.start for s in timeline.spans)


def test_resident_blocks_pass_through_small_pinned_staging(tiny, monkeypatch):
    layout, expected = tiny
    monkeypatch.setattr(zerolite.runtime.resident, "STAGING_BYTES", 8192)  # every block in several pieces
    sim = SimulatedDevice(seed=3)
    with sim.watching():
        with zerolite.load(layout, device=sim, offload="none", show_progress=False) as lm:
            assert torch.equal(greedy(lm, ROWS, NEW_TOKENS), expected)
    assert sim.peak_pinned <= 2 * sim.pinned_cost(8192)  # never the whole model on the host


def test_kv_offload_neither_synchronises_the_device_nor_leaves_a_fetch_behind(tiny, monkeypatch):
    layout, expected = tiny
    monkeypatch.setattr(zerolite.runtime.kv_cache, "MIN_TOKENS", 1)  # the host buffers grow at every other step
    sim = SimulatedDevice(seed=5)
    synchronised = []
    with sim.watching():
        with zerolite.load(layout, device=sim, offload="nvme", cpu_memory=0, gpu_memory=0, show_progress=False) as lm:
            monkeypatch.setattr(sim, "synchronize", lambda stream=None: synchronised.append(stream))
            cache = PartialOffloadCache(lm.config, 1.0, sim)
            assert torch.equal(greedy(lm, ROWS, NEW_TOKENS, cache=cache), expected)
            assert synchronised == []  # closing waits for the ring's copies; generating waits for nothing whole
    assert all(layer._fetched is None for layer in cache.layers if isinstance(layer, HostLayer))


def test_host_to_device_bandwidth_is_timed_on_the_measured_device():
    sim = adopted_device()
    assert measure_host_to_device(sim, nbytes=1 << 20, repeats=2) > 0

    class Instant(SimulatedDevice):
        def record(self, stream=None, timing=False):
            event = super().record(stream, timing)
            event.elapsed_time = lambda end: 0.0
            return event

    instant = Instant()
    instant.adopt_thread()
    assert measure_host_to_device(instant, nbytes=1 << 20, repeats=2) is None  # no division by zero


def test_an_id_past_the_vocabulary_is_one_clear_error_and_the_device_stays_usable(tiny):
    layout, expected = tiny
    sim = SimulatedDevice()
    with zerolite.load(layout, device=sim, cpu_memory=0, show_progress=False) as lm:
        with pytest.raises(ZeroliteError, match="vocabulary"):
            lm.generate(input_ids=torch.tensor([[1, 10_000]]), max_new_tokens=2)
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS), expected)


def test_static_caches_are_refused_and_compilation_is_off(tiny):
    layout, _ = tiny
    with zerolite.load(layout, device=SimulatedDevice(), cpu_memory=0, show_progress=False) as lm:
        assert lm.generation_config.disable_compile is True
        with pytest.raises(ZeroliteError, match="static cache"):
            greedy(lm, ROWS, NEW_TOKENS, cache_implementation="static")
        with pytest.raises(ZeroliteError, match="static cache"):  # under transformers 4's name too
            greedy(lm, ROWS, NEW_TOKENS, past_key_values=StaticCache(config=lm.config, max_cache_len=32))
        with pytest.raises(ZeroliteError, match="static cache"):
            greedy(lm, ROWS, NEW_TOKENS, cache=StaticCache(config=lm.config, max_cache_len=32))


def test_batch_size_auto_counts_host_kv_at_what_pinning_takes(tiny, monkeypatch):
    """With every layer's K/V in pinned host memory, a sequence costs its K/V doubled (the host
    buffers grow by doubling), rounded as pinning rounds it."""
    layout, _ = tiny
    sim = SimulatedDevice(memory_bytes=1 << 40)  # device memory is never the limit here
    sim.pinned_cost = power_of_two
    with zerolite.load(layout, device=sim, cpu_memory=0, gpu_memory=0, kv_offload=1.0, show_progress=False) as lm:
        prompt, new = 40, 24
        kv = kv_bytes_per_token(lm.config, lm.model.dtype) * (prompt + new)
        cost = sim.pinned_cost(2 * kv)
        assert cost > 2 * kv
        available = 100.5 * cost / (1 - MARGIN)
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda: namedtuple("memory", "available total")(available, 1 << 40))
        assert largest_batch(lm, [prompt] * 1000, new) == 100


def test_loading_makes_the_models_device_current_in_one_process_too(tiny, monkeypatch):
    """On --device cuda:1 without torchrun as with it: otherwise what transformers allocates on
    "cuda" while loading would land on GPU 0."""
    layout, _ = tiny
    sim = SimulatedDevice()
    adopted = []
    adopt = sim.adopt_thread
    monkeypatch.setattr(sim, "adopt_thread", lambda: adopted.append(threading.get_ident()) or adopt())
    with zerolite.load(layout, device=sim, cpu_memory=0, show_progress=False):
        assert adopted == [threading.get_ident()]


def test_a_copy_between_the_device_and_pageable_host_memory_is_caught():
    """A GPU runs it synchronously, the host blocked: the overlap the ring exists for is gone."""
    sim = adopted_device()
    target, stream = sim.empty(8192), sim.new_stream()
    sim.wait_stream(stream, sim.compute)  # target comes from compute's memory
    with pytest.raises(PageableCopyError, match="pageable host memory"):
        sim.copy(target, aligned_empty(8192), stream)
    pinned = sim.pinned_empty(8192).view(torch.int32)[:1024]  # pinned through a view of it, the first tensor gone
    sim.copy(target.view(torch.int32)[:1024], pinned, stream)
    sim.synchronize()


def test_device_work_from_a_thread_that_never_adopted_the_device_is_caught(tiny):
    """On a GPU it would go to that thread's current device (GPU 0, a context there included): the
    server's engine thread adopts the model's device first."""
    layout, _ = tiny
    sim = SimulatedDevice()
    with zerolite.load(layout, device=sim, cpu_memory=0, gpu_memory=0, show_progress=False) as lm:
        failed = []
        thread = threading.Thread(target=lambda: failed.append(pytest.raises(OrderingError, greedy, lm, ROWS, 2)))
        thread.start()
        thread.join()
        assert "never adopted the device" in str(failed[0].value)


# The ledger's rules, one at a time, on hand-made work: each break is caught, and the same work
# with its ordering step is not.


def test_the_simulated_ledger_tracks_byte_ranges_so_a_half_waited_for_is_readable():
    sim = adopted_device(max_delay_s=0.02)
    stream, host, target = sim.new_stream(), sim.pinned_empty(8192), sim.empty(8192)
    sim.wait_stream(stream, sim.compute)  # target comes from compute's memory
    with sim.watching():
        sim.copy(target[:4096], host[:4096], stream)
        first = sim.record(stream)
        sim.copy(target[4096:], host[4096:], stream)  # still landing
        sim.wait_event(sim.compute, first)
        target[:4096].sum()
        with pytest.raises(OrderingError, match="before the copy on stream1 that fills it"):
            target[4096:].sum()


def test_the_simulated_ledger_lets_grouped_mm_read_only_the_experts_routed_to():
    sim = adopted_device(max_delay_s=0.02)
    stream, host, slot = sim.new_stream(), sim.pinned_empty(4 * 16 * 4), sim.empty(4 * 16 * 4)
    experts = slot.view(torch.float32).view(4, 4, 4)
    sim.wait_stream(stream, sim.compute)
    with sim.watching():
        sim.copy(slot[:2 * 64], host[:2 * 64], stream)  # experts 0 and 1
        sim.wait_event(sim.compute, sim.record(stream))
        sim.copy(slot[3 * 64:], host[3 * 64:], stream)  # expert 3, guessed, still landing
        rows = torch.ones(3, 4)
        torch._grouped_mm(rows, experts, offs=torch.tensor([1, 3, 3, 3], dtype=torch.int32))  # tokens to 0 and 1
        with pytest.raises(OrderingError, match="fills it"):
            torch._grouped_mm(rows, experts, offs=torch.tensor([1, 2, 2, 3], dtype=torch.int32))  # one to 3


def test_the_simulated_ledger_orders_a_copy_after_computes_write_of_what_it_reads():
    sim = adopted_device()
    appends, host = sim.new_stream(), sim.pinned_empty(64)
    with sim.watching():
        keys = torch.ones(16) * 2  # made by compute
        with pytest.raises(OrderingError, match="before compute's write"):
            sim.copy(host.view(torch.float32), keys, appends)
        keys = torch.ones(16) * 3
        sim.wait_stream(appends, sim.compute)
        sim.copy(host.view(torch.float32), keys, appends)
        sim.keep_alive(keys, appends)


def test_the_simulated_allocator_orders_a_copy_into_computes_memory_after_the_allocation():
    sim = adopted_device()
    stream, host = sim.new_stream(), sim.pinned_empty(4096)
    target = sim.empty(4096)
    with pytest.raises(OrderingError, match="from compute's pool before it is ordered after the allocation"):
        sim.copy(target, host, stream)
    sim.wait_stream(stream, sim.compute)
    sim.copy(target, host, stream)
    sim.synchronize()


@pytest.mark.parametrize("kept", [False, True])
def test_the_simulated_allocator_needs_keep_alive_for_memory_freed_while_another_stream_uses_it(kept):
    sim = adopted_device(max_delay_s=0.02)
    appends, host = sim.new_stream(), sim.pinned_empty(64)
    with pytest.raises(OrderingError, match="freed without keep_alive") if not kept else contextlib.nullcontext():
        with sim.watching():
            keys = torch.ones(16) * 2
            sim.wait_stream(appends, sim.compute)
            sim.copy(host.view(torch.float32), keys, appends)
            if kept:
                sim.keep_alive(keys, appends)
            del keys  # compute's pool may hand it out again while the copy still reads it
            sim.synchronize()


def test_the_simulated_allocator_catches_pinned_memory_freed_under_a_copy():
    sim = adopted_device(max_delay_s=0.02)
    stream, target = sim.new_stream(), sim.empty(4096)
    sim.wait_stream(stream, sim.compute)
    host = sim.pinned_empty(4096)
    sim.copy(target, host, stream)
    del host  # unpinned and unmapped while the copy may still read it
    with pytest.raises(OrderingError, match="pinned host memory freed while a copy"):
        sim.synchronize()


def test_the_simulated_compute_stream_lags_the_host():
    sim = adopted_device(max_delay_s=0.05, seed=1)
    begin, end = sim.record(timing=True), sim.record(timing=True)
    with pytest.raises(RuntimeError, match="not yet done"):
        begin.elapsed_time(end)
    end.synchronize()
    begin.synchronize()
    assert begin.elapsed_time(end) >= 0


def test_kv_host_buffers_are_pinned_once_per_job_and_reused_by_the_next_on_the_simulated_device(tiny, monkeypatch):
    """Pinning registers memory with the driver, milliseconds per GB: not on the hot path. Made at the
    job's length (no growth where the buffers would have grown at every other step), and the next
    batch of that shape takes them back from the pool."""
    layout, expected = tiny
    monkeypatch.setattr(zerolite.runtime.kv_cache, "MIN_TOKENS", 1)
    sim = SimulatedDevice(seed=11)
    pins = []
    pinned_empty = sim.pinned_empty
    monkeypatch.setattr(sim, "pinned_empty", lambda nbytes: pins.append(nbytes) or pinned_empty(nbytes))
    with sim.watching():
        with zerolite.load(layout, device=sim, offload="nvme", cpu_memory=0, gpu_memory=0, kv_offload=1.0,
                           show_progress=False) as lm:
            for job in range(2):
                before = len(pins)
                assert torch.equal(greedy(lm, ROWS, NEW_TOKENS), expected)
                assert len(pins) - before == (2 * LAYERS if job == 0 else 0), job
