"""Pinned host memory on the GPU's NUMA node (issue 37, defect 9), with the machine's sysfs, libnuma and
CUDA's driver stood in for: asked of the GPU's node before registering touches it, where the machine
has several nodes; nothing asked on a machine of one (this one, and the H100 seen: numa_node -1)."""

from __future__ import annotations

import ctypes
import mmap
import platform
from types import SimpleNamespace

import pytest
import torch

import zerolite.io.device
import zerolite.io.numa
from support.fake_cuda import FakeLibcuda
from zerolite.io.device import CudaDevice, CudaDriver
from zerolite.io.engine import host_bytes
from zerolite.io.numa import MPOL_PREFERRED, SYS_MBIND, SystemCall, prefer_node

GPU_AT = "0000:18:00.0"


class FakeLibnuma:
    def __init__(self, driver: FakeLibcuda):
        self.driver = driver
        self.calls = []

    def mbind(self, address, nbytes, mode, mask, maxnode, flags) -> int:
        nodes = {word * 64 + bit for word in range(len(mask)) for bit in range(64) if mask[word] >> bit & 1}
        self.calls.append((address.value, nbytes.value, mode.value, nodes, len(self.driver.registered)))
        return 0


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine of nodes whose GPU 0 sits at GPU_AT: machine(nodes=2, gpu_node=1) -> the fake libnuma."""
    driver = FakeLibcuda()
    monkeypatch.setattr(zerolite.io.device, "cuda_driver", lambda: CudaDriver(driver))
    properties = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    libnuma = FakeLibnuma(driver)
    monkeypatch.setattr(zerolite.io.numa, "numa_library", lambda: libnuma)

    def make(nodes: int, gpu_node: int) -> FakeLibnuma:
        for node in range(nodes):
            (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "pci" / GPU_AT).mkdir(parents=True)
        (tmp_path / "pci" / GPU_AT / "numa_node").write_text(f"{gpu_node}\n")
        monkeypatch.setattr(zerolite.io.numa, "NODES", tmp_path / "node")
        monkeypatch.setattr(zerolite.io.numa, "PCI_DEVICES", tmp_path / "pci")
        return libnuma

    return make


def test_pinned_memory_is_asked_of_the_gpus_node_before_it_is_registered(machine):
    libnuma = machine(nodes=2, gpu_node=1)
    buffer = CudaDevice(torch.device("cuda", 0)).pinned_empty(3 << 20)
    assert libnuma.calls == [(buffer.data_ptr(), host_bytes(3 << 20), MPOL_PREFERRED, {1}, 0)]


@pytest.mark.parametrize(("nodes", "gpu_node"), [(1, -1), (1, 0), (2, -1)])
def test_nothing_is_asked_where_there_is_one_node_or_the_firmware_names_none(machine, nodes, gpu_node):
    libnuma = machine(nodes=nodes, gpu_node=gpu_node)
    CudaDevice(torch.device("cuda", 0)).pinned_empty(4096)
    assert libnuma.calls == []


def test_the_kernel_takes_the_request_through_libnuma_and_the_system_call():
    """On this machine's own node 0: the arguments as the kernel reads them."""
    mapping = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert prefer_node(address, 1 << 20, 0)
    if platform.machine() in SYS_MBIND:
        call = SystemCall(SYS_MBIND[platform.machine()])
        assert call.mbind(ctypes.c_void_p(address), ctypes.c_ulong(1 << 20), ctypes.c_int(MPOL_PREFERRED),
                          (ctypes.c_ulong * 1)(1), ctypes.c_ulong(65), ctypes.c_uint(0)) == 0
