"""CUDA's caching allocator and a K/V cache that grows a token each step (issue 37, defect 3): zerolite
asks for segments that grow in place before CUDA starts, leaves a user's own setting alone, and
--batch-size auto counts what growing tensors take where segments cannot grow."""

from __future__ import annotations

import os

import pytest
import torch

import zerolite
from support.simulated_device import SimulatedDevice
from zerolite.io.device import ALLOCATOR_SETTINGS, CudaDevice
from zerolite.memory_model import kv_bytes_per_token
from zerolite.runtime.batching import largest_batch


@pytest.fixture
def no_settings(monkeypatch):
    for name in ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def test_segments_grow_unless_the_user_configured_the_allocator_or_cuda_started(no_settings):
    device = CudaDevice(torch.device("cuda", 0))  # torch.cuda not called: the index is given
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert device.growing_cost(1000) == 1000

    no_settings.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")  # the user's: kept, and known not to grow
    no_settings.delenv("PYTORCH_CUDA_ALLOC_CONF")
    device = CudaDevice(torch.device("cuda", 0))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:128"
    assert device.growing_cost(1000) == 2000

    no_settings.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6, expandable_segments:True")
    assert CudaDevice(torch.device("cuda", 0)).growing_cost(1000) == 1000

    for name in ALLOCATOR_SETTINGS:
        no_settings.delenv(name, raising=False)
    no_settings.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: torch has read its settings
    assert CudaDevice(torch.device("cuda", 0)).growing_cost(1000) == 2000
    assert not any(name in os.environ for name in ALLOCATOR_SETTINGS)


def test_batch_size_auto_counts_growing_kv_twice_where_segments_cannot_grow(make_layout):
    layout = make_layout("llama", layers=2)
    prompt, new = 4, 1000  # K/V, not the prefill's activations, sets the batch
    sim = SimulatedDevice(memory_bytes=1 << 40)
    with zerolite.load(layout, device=sim, cpu_memory=0, gpu_memory=0, show_progress=False) as lm:
        kv = kv_bytes_per_token(lm.config, lm.model.dtype) * (prompt + new)
        sim.memory_bytes = sim.allocated + int(1000 * kv / 0.9)  # device memory is the limit, less MARGIN
        growing = largest_batch(lm, [prompt] * 4096, new)
        sim.growing_cost = lambda nbytes: 2 * nbytes
        fixed = largest_batch(lm, [prompt] * 4096, new)
    assert 900 < growing < 1000 and 0.49 * growing < fixed < 0.51 * growing
