"""Host memory on the GPU's NUMA node: on a machine of several nodes, a copy to the GPU from memory
on the other socket crosses the link between sockets first, and loses rate to it; the pinned
host tiers (held layers, the ring's host slots, K/V buffers) are asked of the GPU's node.

    node = gpu_node("0000:18:00.0")       # None on a machine of one node, or where the firmware says none (-1)
    prefer_node(address, nbytes, node)    # before the first touch: pages come from node while it has them

Preferred, not bound: a node that runs out gives pages from another, as the kernel's default
would, instead of failing the run. Through libnuma's mbind where it is installed, else the same
system call; where neither works the memory is placed as before (first touch), which runs.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

NODES = Path("/sys/devices/system/node")
PCI_DEVICES = Path("/sys/bus/pci/devices")
MPOL_PREFERRED = 1
SYS_MBIND = {"x86_64": 237, "aarch64": 235}  # where libnuma is not installed: the system call's number


def several_nodes() -> bool:
    return len(list(NODES.glob("node[0-9]*"))) > 1


def gpu_node(pci_address: str) -> int | None:
    """The NUMA node the GPU at pci_address ("0000:18:00.0") hangs off, where the machine has
    several; None on a machine of one (nothing to choose) or where the firmware does not say."""
    if not several_nodes():
        return None
    try:
        node = int((PCI_DEVICES / pci_address.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class SystemCall:
    """mbind as libnuma exports it, made through libc's syscall where libnuma is missing."""

    def __init__(self, number: int):
        self.number = number
        self.libc = ctypes.CDLL(None, use_errno=True)

    def mbind(self, *args) -> int:
        return self.libc.syscall(ctypes.c_long(self.number), *args)


@functools.cache
def numa_library():
    """What mbind is called on: libnuma, or the system call; None where neither is at hand."""
    try:
        return ctypes.CDLL("libnuma.so.1", use_errno=True)
    except OSError:
        number = SYS_MBIND.get(platform.machine())
        return SystemCall(number) if number is not None else None


def prefer_node(address: int, nbytes: int, node: int) -> bool:
    """Asks that the pages of [address, address + nbytes), not touched yet, come from node;
    whether the kernel took it (a failure leaves the memory where first touch puts it)."""
    library = numa_library()
    if library is None:
        return False
    bits = 64
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    status = library.mbind(ctypes.c_void_p(address), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED), mask,
                           ctypes.c_ulong(len(mask) * bits + 1), ctypes.c_uint(0))
    return status == 0
