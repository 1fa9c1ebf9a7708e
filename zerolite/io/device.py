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
device (tests/simulated_device.py) whose copies run on threads, so that a missing wait shows up as
wrong bytes. Events follow torch.cuda.Event's interface: record(stream), synchronize() and
elapsed_time(other) in milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import time

import psutil
import torch

from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT, aligned_empty, host_bytes, host_mapping


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
        such as the server's engine loop, would otherwise start on device 0)."""

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

    def to_device(self, host: torch.Tensor, stream) -> torch.Tensor:
        """A device copy of host, allocated for and queued on stream (host itself where memory is shared)."""
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

    def adopt_host(self, array: ctypes.Array, mapping: mmap.mmap) -> torch.Tensor:
        """A uint8 tensor over host memory mapped elsewhere (the node's shared copy), page-locked
        where copies need it; the tensor keeps the mapping alive."""
        return torch.frombuffer(array, dtype=torch.uint8)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory."""
        raise NotImplementedError

    def peak_allocated(self) -> int | None:
        """The most device memory tensors held at once (None where host memory is the device's)."""
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

    def new_stream(self):
        return self._STREAM

    def record(self, stream=None, timing: bool = False) -> HostEvent:
        return HostEvent()

    def wait_event(self, stream, event) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        dst.copy_(src)

    def to_device(self, host: torch.Tensor, stream) -> torch.Tensor:
        return host

    def empty(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes)

    def memory(self) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total


class CudaDevice(Device):
    """One CUDA device through torch.cuda. Pinned host memory is allocated at its exact size (page
    rounded) and registered with cudaHostRegister, not taken from torch's pinned caching allocator,
    which rounds every allocation up to a power of two and keeps freed blocks pinned: a 1.71 GB
    Llama-70B layer would lock 2 GiB, a 2.9 GB Mixtral layer 4 GiB."""

    separate_memory = True

    def __init__(self, torch_device: torch.device):
        index = torch_device.index if torch_device.index is not None else torch.cuda.current_device()
        self.torch_device = torch.device("cuda", index)
        self.name = str(self.torch_device)

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

    def to_device(self, host: torch.Tensor, stream) -> torch.Tensor:
        with torch.cuda.stream(stream):  # allocated for this stream: nothing compute still uses
            return host.to(self.torch_device, non_blocking=True)

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
        return registered_host_memory(max(nbytes, 1))[:nbytes]

    def adopt_host(self, array: ctypes.Array, mapping: mmap.mmap) -> torch.Tensor:
        return registered(array, mapping, "the node's shared host copy")

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.torch_device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)


class _Registration:
    """Keeps a host mapping registered with CUDA while any tensor uses it; on release, unregisters
    it before the mapping goes (the mmap is freed only after this object)."""

    def __init__(self, mapping: mmap.mmap, address: int, cudart):
        self.mapping = mapping
        self.address = address
        self.cudart = cudart  # held: looking it up again at interpreter exit or in a forked child fails

    def __del__(self):
        with contextlib.suppress(Exception):  # nothing to do about a failure while freeing
            self.cudart.cudaHostUnregister(self.address)


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's


def registered_host_memory(nbytes: int) -> torch.Tensor:
    """nbytes of anonymous memory (huge pages where the kernel gives them: zerolite.io.engine.host_mapping),
    page-locked for the GPU."""
    return registered(*host_mapping(host_bytes(nbytes)), "host memory")


def registered(array: ctypes.Array, mapping: mmap.mmap, what: str) -> torch.Tensor:
    """array (inside mapping) page-locked for the GPU, as a uint8 tensor that keeps both alive."""
    address = ctypes.addressof(array)
    cudart = torch.cuda.cudart()
    status = int(cudart.cudaHostRegister(address, len(array), CUDA_HOST_REGISTER_PORTABLE))
    if status != 0:
        raise ZeroliteError(
            f"pinning {len(array) / 1e9:.2f} GB of {what} failed (cudaError {status}): lower `cpu_memory` or `prefetch_depth`"
        )
    array._registration = _Registration(mapping, address, cudart)  # dies with the last tensor using the array
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
