"""CudaDevice's pinned host memory, with CUDA's driver stood in for (tests/support/fake_cuda.py): exact
sizes, chunks a driver accepts, the model's GPU current for every call, and nothing left behind
by a failure."""

from __future__ import annotations

import pytest
import torch

import zerolite.io.device
from support.fake_cuda import FakeLibcuda
from zerolite.errors import ZeroliteError
from zerolite.io.device import CudaDevice, CudaDriver, registered
from zerolite.io.engine import host_mapping


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


def test_a_registration_larger_than_a_chunk_is_made_in_chunks_that_end_only_between_pieces(driver, monkeypatch):
    """Drivers from r580 on are reported to refuse one registration of 512 GiB or more, and a copy
    whose host side spans two registrations fails (seen on an H200): chunks end only where a piece
    (a block of the node's copy) ends; a piece larger than a chunk is one registration, as is a
    buffer from pinned_empty, which a copy may read anywhere."""
    assert zerolite.io.device.REGISTRATION_CHUNK <= 64 << 30
    monkeypatch.setattr(zerolite.io.device, "REGISTRATION_CHUNK", 3 * 4096)
    array, mapping = host_mapping(10 * 4096)
    pages = [0, 1, 3, 4, 8]  # pieces of 1, 2, 1, 4 and 2 pages
    buffer = registered(array, mapping, "pieces", 0, [page * 4096 for page in pages])
    address = buffer.data_ptr()
    assert [call[1:3] for call in driver.calls] == [(address, 3 * 4096), (address + 3 * 4096, 4096),
                                                   (address + 4 * 4096, 4 * 4096), (address + 8 * 4096, 2 * 4096)]
    del buffer, array, mapping
    assert driver.registered == {} and sum(call[0] == "unregister" for call in driver.calls) == 4
    whole = gpu(0).pinned_empty(10 * 4096)
    assert driver.calls[-1][1:3] == (whole.data_ptr(), 10 * 4096)


def test_a_failed_registration_is_one_clear_error_and_leaves_nothing_registered(driver, monkeypatch):
    """The driver returns its error and sets none of the runtime's (a failed cudaHostRegister
    leaves one that the thread's next kernel launch would report as its own): the runtime is not
    used (the fixture fails the test if it is), and the chunks made before the failure are undone."""
    monkeypatch.setattr(zerolite.io.device, "REGISTRATION_CHUNK", 4096)
    driver.fail_at = 2
    array, mapping = host_mapping(5 * 4096)
    with pytest.raises(ZeroliteError,
                       match=r"pinning 0\.00 GB of host memory failed \(CUDA driver error 2\): lower `cpu_memory`"):
        registered(array, mapping, "host memory", 0, [page * 4096 for page in range(5)])
    assert [call[0] for call in driver.calls] == ["register"] * 3 + ["unregister"] * 2
    assert driver.registered == {} and driver.current == [] and driver.held == 0


def test_every_call_runs_in_the_models_gpu_context(driver):
    """On cuda:1, registering under whichever device is current would open a context on GPU 0."""
    buffer = gpu(1).pinned_empty(4096)
    del buffer
    assert [call[-1] for call in driver.calls] == [1, 1] and driver.opened == {1}
    assert driver.current == [] and driver.held == 0  # the thread's own context is back, the retains released


@pytest.mark.cuda
def test_memory_registered_in_chunks_copies_and_a_refused_registration_leaves_the_gpu_working(gpu, monkeypatch):
    """Through CUDA's own driver on a GPU (tools/gpu_check runs it there first), the stand-in on the
    simulated device: memory registered in chunks copies to the GPU and back byte for byte, a piece
    at a time (one copy across two registrations is refused on a GPU); the driver refusing a
    registration (the memory is registered already) is one clear error, and the thread's next
    kernel launch runs."""
    monkeypatch.setattr(zerolite.io.device, "REGISTRATION_CHUNK", 1 << 20)
    real = gpu == "cuda"
    if not real:
        library = FakeLibcuda(fail_at=4)  # the buffer's three chunks, the page, then the page again
        monkeypatch.setattr(zerolite.io.device, "cuda_driver", lambda: CudaDriver(library))
    starts = [0, 1 << 20, 3 << 19, 2 << 20]  # pieces of 1, 0.5, 0.5 and 3 MiB: three chunks
    array, mapping = host_mapping(5 << 20)
    buffer = registered(array, mapping, "pieces", 0, starts)
    buffer.copy_(torch.arange(5 << 20, dtype=torch.int64).to(torch.uint8))
    if real:
        for start, end in zip(starts, [*starts[1:], 5 << 20]):
            piece = buffer[start:end]
            assert torch.equal(piece.to("cuda", non_blocking=True).cpu(), piece)
    else:
        assert len(library.calls) == 3
    array, mapping = host_mapping(4096)
    page = registered(array, mapping, "a page", 0)
    with pytest.raises(ZeroliteError, match=r"pinning 0\.00 GB of a page failed \(CUDA driver error \d+\)"):
        registered(array, mapping, "a page", 0)
    if real:
        assert (torch.ones(8, device="cuda") * 2).sum().item() == 16
    del page
