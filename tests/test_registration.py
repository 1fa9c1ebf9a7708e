"""CudaDevice's pinned host memory, with CUDA's driver stood in for (tests/fake_cuda.py): exact
sizes, chunks a driver accepts, the model's GPU current for every call, and nothing left behind
by a failure."""

from __future__ import annotations

import pytest
import torch

import zerolite.io.device
from fake_cuda import FakeLibcuda
from zerolite.errors import ZeroliteError
from zerolite.io.device import CudaDevice, CudaDriver


@pytest.fixture
def driver(monkeypatch) -> FakeLibcuda:
    """The stand-in libcuda CudaDevice registers through; CUDA's runtime may not be used at all."""
    library = FakeLibcuda()
    monkeypatch.setattr(zerolite.io.device, "cuda_driver", lambda: CudaDriver(library))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("CUDA's runtime registered host memory"))
    return library


def gpu(index: int) -> CudaDevice:
    return CudaDevice(torch.device("cuda", index))


def test_pinned_memory_is_registered_at_its_size_and_unregistered_after_its_last_view(driver):
    """Exact page-rounded sizes (no power-of-two rounding), unregistered only once no tensor uses
    it, before it is unmapped."""
    buffer = gpu(0).pinned_empty(1_710_000_000 // 1000)
    address = buffer.data_ptr()
    assert driver.calls == [("register", address, 1_712_128, 0)] and address % 4096 == 0
    view = buffer[100:200]
    del buffer
    view.fill_(7)  # still mapped and registered
    assert len(driver.calls) == 1
    del view
    assert driver.calls[-1] == ("unregister", address, 0) and driver.registered == {}


def test_a_registration_larger_than_a_chunk_is_made_in_chunks(driver, monkeypatch):
    """Drivers from r580 on are reported to refuse one registration of 512 GiB or more."""
    assert zerolite.io.device.REGISTRATION_CHUNK <= 64 << 30
    monkeypatch.setattr(zerolite.io.device, "REGISTRATION_CHUNK", 3 * 4096)
    buffer = gpu(0).pinned_empty(10 * 4096)
    address = buffer.data_ptr()
    assert [call[1:3] for call in driver.calls] == [(address, 12288), (address + 12288, 12288),
                                                   (address + 24576, 12288), (address + 36864, 4096)]
    del buffer
    assert driver.registered == {} and sum(call[0] == "unregister" for call in driver.calls) == 4


def test_a_failed_registration_is_one_clear_error_and_leaves_nothing_registered(driver, monkeypatch):
    """The driver returns its error and sets none of the runtime's (a failed cudaHostRegister
    leaves one that the thread's next kernel launch would report as its own): the runtime is not
    used (the fixture fails the test if it is), and the chunks made before the failure are undone."""
    monkeypatch.setattr(zerolite.io.device, "REGISTRATION_CHUNK", 4096)
    driver.fail_at = 2
    with pytest.raises(ZeroliteError, match=r"pinning 0\.00 GB of host memory failed \(CUDA driver error 2\): lower `cpu_memory`"):
        gpu(0).pinned_empty(5 * 4096)
    assert [call[0] for call in driver.calls] == ["register"] * 3 + ["unregister"] * 2
    assert driver.registered == {} and driver.current == [] and driver.held == 0


def test_every_call_runs_in_the_models_gpu_context(driver):
    """On cuda:1, registering under whichever device is current would open a context on GPU 0."""
    buffer = gpu(1).pinned_empty(4096)
    del buffer
    assert [call[-1] for call in driver.calls] == [1, 1] and driver.opened == {1}
    assert driver.current == [] and driver.held == 0  # the thread's own context is back, the retains released
