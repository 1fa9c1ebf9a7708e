"""Everything the runtime asks of a device, in one place: streams, events, asynchronous copies,
device and pinned host memory, free memory.

    device = resolve("auto")                    # CudaDevice where there is a GPU, else CpuDevice
    copies = device.new_stream()
    device.wait_event(copies, compute_done)     # the copy may not start before compute is done
    device.copy(slot, host_bytes, copies)       # queued on `copies`; returns at once
    landed = device.record(copies)
    device.wait_event(device.compute_stream(), landed)   # compute waits on the device, the host does not

Three implementations: CudaDevice (the only code in the package that calls torch.cuda), CpuDevice
(one memory: nothing to copy, nothing to wait for) and, for the tests, a simulated asynchronous
device (tests/support/simulated_device.py) whose copies run on threads, so that a missing wait shows up as
wrong bytes. Events follow torch.cuda.Event's interface: record(stream), synchronize() and
elapsed_time(other) in milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch

from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT, aligned_empty, host_bytes, host_mapping
from zerolite.io.numa import gpu_node, prefer_node, several_nodes


class Device:
    """The interface. `separate_memory` says whether device buffers are apart from host memory:
    when they are, bytes must be copied in and every copy ordered against compute by events."""

    name: str
    torch_device: torch.device
    separate_memory: bool

    def compute_stream(self):
        """The stream the model's own work is queued on (the current one)."""
        raise NotImplementedError

    def adopt_thread(self) -> None:
        """Makes this device the calling thread's current one (a thread other than the loader's,
        such as the server's decode loop, would otherwise start on device 0)."""

    def new_stream(self):
        raise NotImplementedError

    def record(self, stream=None, timing: bool = False):
        """An event marking everything queued on stream (default: compute) so far."""
        raise NotImplementedError

    def wait_event(self, stream, event) -> None:
        """Work queued on stream from now on runs after event; the host does not block."""
        raise NotImplementedError

    def wait_stream(self, stream, other) -> None:
        """Work queued on stream from now on runs after everything queued on other so far."""
        self.wait_event(stream, self.record(other))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """dst.copy_(src), queued on stream; src must stay untouched until the copy's event."""
        raise NotImplementedError

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """tensor was made on another stream and is used on this one: its memory must not be reused
        before this stream's work so far has run."""

    def synchronize(self, stream=None) -> None:
        """The host waits for stream's work (default: every stream's)."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 device buffer."""
        raise NotImplementedError

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 host buffer, 4 KiB aligned, page-locked where copies need it."""
        return aligned_empty(nbytes)

    def pinned_cost(self, nbytes: int) -> int:
        """Host memory that pinned_empty(nbytes) really takes (and locks): what budgets count."""
        return host_bytes(nbytes)

    def adopt_host(self, array: ctypes.Array, mapping: mmap.mmap, starts: Sequence[int] = (0,)) -> torch.Tensor:
        """A uint8 tensor over host memory mapped elsewhere (the node's shared copy), page-locked
        where copies need it; the tensor keeps the mapping alive. starts: where the pieces that one
        copy may read begin (the blocks), from 0 on."""
        return torch.frombuffer(array, dtype=torch.uint8)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory."""
        raise NotImplementedError

    def peak_allocated(self) -> int | None:
        """The most device memory tensors held at once (None where host memory is the device's)."""
        return None

    def growing_cost(self, nbytes: int) -> int:
        """Device memory that tensors made a token longer at each step, up to nbytes (the K/V cache
        a DynamicCache keeps by torch.cat, an offloaded layer's fetch), really take from the allocator."""
        return nbytes

    def processor(self) -> str:
        """What computes: the CPU's or GPU's model, as figures measured on it are kept under."""
        return self.name

    def identity(self) -> str | None:
        """What tells this GPU from every other on the node, whatever number a process sees it under
        (CUDA_VISIBLE_DEVICES renumbers them): its UUID. None where there is no device memory to share."""
        return None


class HostEvent:
    """An event on a device with one memory: everything queued has already run when it is made."""

    def __init__(self):
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.time - self.time) * 1e3


class CpuDevice(Device):
    """Host memory is device memory: a block's bytes in a host buffer are what compute uses."""

    name = "cpu"
    torch_device = torch.device("cpu")
    separate_memory = False
    _STREAM = "cpu"  # the only stream: the host thread

    def compute_stream(self):
        return self._STREAM

    def processor(self) -> str:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or "cpu"

    def new_stream(self):
        return self._STREAM

    def record(self, stream=None, timing: bool = False) -> HostEvent:
        return HostEvent()

    def wait_event(self, stream, event) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        dst.copy_(src)

    def empty(self, nbytes: int) -> torch.Tensor:
        # a resident block's home: read into once (io.engine.host_mapping)
        return aligned_empty(nbytes, huge_pages=False)

    def memory(self) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total


class CudaDevice(Device):
    """One CUDA device through torch.cuda. Pinned host memory is allocated at its exact size (page
    rounded) and registered through CUDA's driver (CudaDriver), not taken from torch's pinned
    caching allocator, which rounds every allocation up to a power of two and keeps freed blocks
    pinned: a 1.71 GB Llama-70B layer would lock 2 GiB, a 2.9 GB Mixtral layer 4 GiB."""

    separate_memory = True

    def __init__(self, torch_device: torch.device):
        self.segments_grow = grow_segments()  # first: current_device() below may start CUDA
        index = torch_device.index if torch_device.index is not None else torch.cuda.current_device()
        self.torch_device = torch.device("cuda", index)
        self.name = str(self.torch_device)

    def processor(self) -> str:
        return torch.cuda.get_device_name(self.torch_device)

    def identity(self) -> str:
        return str(torch.cuda.get_device_properties(self.torch_device).uuid)

    def compute_stream(self):
        return torch.cuda.current_stream(self.torch_device)

    def adopt_thread(self) -> None:
        torch.cuda.set_device(self.torch_device)

    def new_stream(self):
        return torch.cuda.Stream(self.torch_device)

    def record(self, stream=None, timing: bool = False):
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream if stream is not None else self.compute_stream())
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def synchronize(self, stream=None) -> None:
        if stream is None:
            torch.cuda.synchronize(self.torch_device)
        else:
            stream.synchronize()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return registered_host_memory(max(nbytes, 1), self.torch_device.index, self.numa_node)[:nbytes]

    @functools.cached_property
    def numa_node(self) -> int | None:
        """The NUMA node pinned memory is asked of (zerolite.io.numa): the GPU's, where the machine has
        several nodes and says which; None where it has one (the sysfs look comes first: no CUDA call)."""
        if not several_nodes():
            return None
        properties = torch.cuda.get_device_properties(self.torch_device)
        return gpu_node(f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0")

    def adopt_host(self, array: ctypes.Array, mapping: mmap.mmap, starts: Sequence[int] = (0,)) -> torch.Tensor:
        return registered(array, mapping, "the node's shared host copy", self.torch_device.index, starts)

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.torch_device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)

    def growing_cost(self, nbytes: int) -> int:
        """Twice the bytes where the allocator's segments cannot grow: each step's longer tensor
        needs a block the freed shorter ones are too small to give, so they stay cached beside it."""
        return nbytes if self.segments_grow else 2 * nbytes


ALLOCATOR_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either, once, as CUDA starts
GROWING_SEGMENTS = "expandable_segments:True"


def grow_segments() -> bool:
    """Asks CUDA's caching allocator for segments that grow in place (expandable_segments), unless
    the user configured the allocator or CUDA has started (torch reads the setting once, then):
    the K/V cache, an offloaded layer's fetch and its torch.cat all grow by a token each step, and
    fixed segments leave each step's shorter blocks cached beside the longer one, until a full GPU
    frees every cached block (cudaFree, which waits for the whole device) or runs out. Returns
    whether the allocator grows its segments, for the budgets (growing_cost)."""
    if not any(name in os.environ for name in ALLOCATOR_SETTINGS) and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = GROWING_SEGMENTS
    settings = ",".join(os.environ.get(name, "") for name in ALLOCATOR_SETTINGS).replace(" ", "")
    return GROWING_SEGMENTS.lower() in settings.lower().split(",")


REGISTRATION_CHUNK = 64 << 30
"""The most one registration pins where the memory can be split: drivers from r580 on are
reported to refuse a single registration of 512 GiB or more (a 405B model's host tier in bf16)."""

CU_MEMHOSTREGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the registering one


class CudaDriver:
    """Host memory registration through CUDA's driver API (libcuda). Not the runtime's
    cudaHostRegister: a failed one leaves the runtime's last error set, which torch's binding does
    not clear, so the thread's next kernel launch fails with a misattributed "out of memory"; a
    driver call returns its error and leaves none behind. Each call runs in the primary context of
    the model's GPU (the one torch's runtime uses there): under whichever device happens to be
    current, it would create a context on GPU 0, hundreds of MB of someone else's GPU."""

    def __init__(self, library=None):
        self.library = library if library is not None else ctypes.CDLL("libcuda.so.1")
        self._check(self.library.cuInit(0), "starting CUDA's driver")

    @contextlib.contextmanager
    def current(self, index: int):
        """GPU index's primary context made current on this thread, and the previous one back after."""
        device, context = ctypes.c_int(), ctypes.c_void_p()
        self._check(self.library.cuDeviceGet(ctypes.byref(device), index), f"finding GPU {index}")
        self._check(self.library.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                    f"opening GPU {index}'s context")
        try:
            self._check(self.library.cuCtxPushCurrent_v2(context), f"making GPU {index}'s context current")
            try:
                yield
            finally:
                self.library.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            self.library.cuDevicePrimaryCtxRelease_v2(device)

    def register(self, address: int, nbytes: int) -> int:
        """Page-locks [address, address + nbytes) in the current context: CUDA's status, 0 for success."""
        return int(self.library.cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                                                     ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE)))

    def unregister(self, address: int) -> None:
        self.library.cuMemHostUnregister(ctypes.c_void_p(address))

    @staticmethod
    def _check(status: int, doing: str) -> None:
        if status != 0:
            raise ZeroliteError(f"{doing} failed (CUDA driver error {status})")


@functools.cache
def cuda_driver() -> CudaDriver:
    return CudaDriver()


class _Registration:
    """Keeps a host mapping registered with CUDA, in chunks, while any tensor uses it, and
    unregisters them before the mapping goes (the mmap is freed only after this object)."""

    def __init__(self, mapping: mmap.mmap, driver: CudaDriver, index: int):
        self.mapping = mapping
        self.driver = driver  # held: looking it up again at interpreter exit or in a forked child fails
        self.index = index
        self.chunks: list[int] = []

    def unregister_all(self) -> None:
        with self.driver.current(self.index):
            while self.chunks:
                self.driver.unregister(self.chunks.pop())

    def __del__(self):
        with contextlib.suppress(Exception):  # nothing to do about a failure while freeing
            self.unregister_all()


def registered_host_memory(nbytes: int, index: int, node: int | None = None) -> torch.Tensor:
    """nbytes of anonymous memory (huge pages where the kernel gives them: zerolite.io.engine.host_mapping),
    from NUMA node where one is given (before registering touches the pages), page-locked for GPU index."""
    array, mapping = host_mapping(host_bytes(nbytes))
    if node is not None:
        prefer_node(ctypes.addressof(array), len(array), node)
    return registered(array, mapping, "host memory", index)


def registration_chunks(nbytes: int, starts: Sequence[int]) -> list[tuple[int, int]]:
    """The (start, length) ranges to register: whole pieces, a piece running from one of starts to
    the next, as many to a range as fit in REGISTRATION_CHUNK (one larger piece alone). A copy reads
    within one piece, and CUDA refuses one whose host side spans two registrations (an H200, driver
    580: cudaErrorInvalidValue), so no registration may end inside a piece."""
    chunks: list[tuple[int, int]] = []
    for start, end in zip(starts, [*starts[1:], nbytes]):
        if chunks and end - chunks[-1][0] <= REGISTRATION_CHUNK:
            chunks[-1] = (chunks[-1][0], end - chunks[-1][0])
        else:
            chunks.append((start, end - start))
    return chunks


def registered(array: ctypes.Array, mapping: mmap.mmap, what: str, index: int,
               starts: Sequence[int] = (0,)) -> torch.Tensor:
    """array (inside mapping) page-locked for GPU index, in registration_chunks of its pieces
    (which begin at starts), as a uint8 tensor that keeps both alive."""
    address, nbytes = ctypes.addressof(array), len(array)
    registration = _Registration(mapping, cuda_driver(), index)
    with registration.driver.current(index):
        for start, length in registration_chunks(nbytes, starts):
            status = registration.driver.register(address + start, length)
            if status != 0:
                registration.unregister_all()
                raise ZeroliteError(f"pinning {nbytes / 1e9:.2f} GB of {what} failed (CUDA driver error {status}): "
                                    "lower `cpu_memory` or `prefetch_depth`")
            registration.chunks.append(address + start)
    array._registration = registration  # dies with the last tensor using the array
    tensor = torch.frombuffer(array, dtype=torch.uint8)
    assert tensor.data_ptr() % ALIGNMENT == 0
    return tensor


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    return torch.cuda.device_count()


def resolve(spec: str | Device) -> Device:
    """A Device from --device ("auto", "cpu", "cuda", "cuda:N"), or the Device given."""
    if isinstance(spec, Device):
        return spec
    if spec == "auto":
        spec = "cuda" if cuda_available() else "cpu"
    if spec == "cpu":
        return CpuDevice()
    return CudaDevice(torch.device(spec))
