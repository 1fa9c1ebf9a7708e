"""A simulated asynchronous device, so that zerolite's CUDA ordering runs, and can fail, on a CPU.

    device = SimulatedDevice(seed=0, memory_bytes=1 << 30)
    with device.watching():                        # the ledger checks every read of device memory
        lm = zerolite.load(layout, device=device)
        lm.generate(...)

Device memory is separate CPU tensors, so every copy really happens. The compute stream is the
calling thread: work runs as it is queued, as if the GPU were infinitely fast. Every other stream is
a worker thread running its queue in order; a copy lands in chunks after a seeded random delay, so
compute that reads a buffer before its copy has landed sees wrong bytes. Events are real: they
complete when their stream reaches them, with timestamps; elapsed_time raises, as CUDA's does, unless
both events were made for timing and are done (the host must have synchronized them).

A happens-before ledger (vector clocks, assigned when work is queued, as CUDA orders it) checks
four rules and raises OrderingError at the first break:
  - a copy into a device buffer is ordered after compute's last read of it;
  - compute reads a device buffer only after the copy that filled it (it waited for its event);
  - a copy reads a buffer only after the copy on another stream that last wrote it (K/V appends
    before the next fetch);
  - the engine reads into a host buffer only once the host has seen every copy from it finish.
compute_after_copies() checks a fourth, at teardown: compute is ordered after every copy queued.
Every copy's host side must be pinned (pinned_empty, adopt_host), or PageableCopyError: CUDA runs a
copy from pageable memory synchronously, the host blocked, and the overlap is gone.
Device work (an allocation, a copy, an event, a wait) queued from a thread that never called
adopt_thread raises OrderingError: on a GPU it would go to that thread's current device, GPU 0.
Under watching(), each adopted thread's compute reads are checked as the watching thread's are.

Free device memory comes from a configured total; pinned host allocations are counted at the
next power of two, the way torch's pinned caching allocator rounds them.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerolite.io.device import Device
from zerolite.io.engine import IoEngine, aligned_empty


class OrderingError(AssertionError):
    """The runtime broke a happens-before rule that a real GPU would punish with a race."""


class PageableCopyError(AssertionError):
    """A copy between the device and host memory that is not pinned: a real GPU would block the host on it."""


class SimulatedStream:
    def __init__(self, device: SimulatedDevice, name: str, threaded: bool):
        self.device = device
        self.name = name
        self.clock = {name: 0}   # vector clock: what work queued on this stream from now on comes after
        self._queue: queue.Queue | None = None
        if threaded:
            self._queue = queue.Queue()
            threading.Thread(target=self._run, name=f"sim-{name}", daemon=True).start()

    def submit(self, work) -> None:
        """Runs work now (compute) or in order on the stream's thread."""
        if self._queue is None:
            work()
        else:
            self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work()
            except BaseException as e:  # re-raised on the host at the next synchronisation
                self.device.failures.append(e)
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        if self._queue is not None:
            self._queue.join()

    def epoch(self) -> int:
        return self.clock[self.name]

    def tick(self) -> None:
        self.clock[self.name] += 1

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class SimulatedEvent:
    def __init__(self, device: SimulatedDevice, timing: bool = False):
        self.device = device
        self.timing = timing
        self.stream: SimulatedStream | None = None
        self.clock: dict[str, int] = {}
        self.time: float | None = None
        self._done = threading.Event()

    def record(self, stream: SimulatedStream) -> None:
        self.stream = stream
        self.clock = dict(stream.clock)
        stream.tick()
        stream.submit(self._complete)

    def _complete(self) -> None:
        self.time = time.perf_counter()
        self._done.set()

    def synchronize(self) -> None:
        if self.device.skip_synchronize(self):
            return
        self._done.wait()
        self.device.raise_failures()
        self.device.host_saw(self)

    def elapsed_time(self, end: SimulatedEvent) -> float:
        """As torch.cuda.Event's: both events made for timing, and both done, or RuntimeError."""
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs both events created with timing=True")
        if not (self._done.is_set() and end._done.is_set()):
            raise RuntimeError("elapsed_time on an event not yet done: synchronize it first")
        return (end.time - self.time) * 1e3


def merge(into: dict[str, int], other: dict[str, int]) -> None:
    for name, epoch in other.items():
        into[name] = max(into.get(name, -1), epoch)


class BufferRecord:
    """What the ledger knows of one device buffer (a storage)."""

    def __init__(self):
        self.last_copy: tuple[str, int] | None = None   # (stream, epoch) of the copy that filled it
        self.last_read = -1                             # compute's epoch at its last read


class SimulatedDevice(Device):
    separate_memory = True

    def __init__(self, seed: int = 0, memory_bytes: int = 8 << 30, max_delay_s: float = 0.002, chunks: int = 4):
        self.name = "sim"
        self.torch_device = torch.device("cpu")
        self.memory_bytes = memory_bytes
        self.max_delay_s = max_delay_s
        self.chunks = chunks
        self.random = random.Random(seed)
        self.failures: list[BaseException] = []
        self.compute = SimulatedStream(self, "compute", threaded=False)
        # What the host has seen finish (synchronize). Apart from compute's clock: compute
        # waiting for an event on the device tells the host nothing, even though here the calling
        # thread is what waits.
        self.host_clock: dict[str, int] = {}
        self.streams = [self.compute]
        self._buffers: dict[int, BufferRecord] = {}          # storage address -> record
        self._copies_from: dict[int, list[tuple[str, int]]] = {}  # host storage address -> copies reading it
        self._written_by: dict[int, tuple[str, int]] = {}  # storage address -> the last copy into it
        self._all_copies: list[tuple[str, int]] = []
        self._pinned: set[int] = set()  # storage addresses of pinned host memory
        self._adopted: set[int] = set()  # the threads that made this device their current one
        self._watcher: int | None = None  # the thread whose with watching() checks compute's reads
        self._lock = threading.Lock()
        self.allocated = self.peak = 0
        self.pinned = self.peak_pinned = 0
        self.adopted = 0          # host memory mapped elsewhere and registered here (the node's shared copy)
        self.skipped_waits = []   # predicates (stream, event) -> True to drop a wait: removing an ordering step
        self.skipped_synchronizes = []  # predicates (event) -> True to drop a host wait

    # threads

    def adopt_thread(self) -> None:
        """The calling thread's work goes to this device from now on; under watching(), its compute's
        reads are checked too (torch's dispatch modes belong to one thread: the mode entered here
        lasts as long as the thread)."""
        self._adopted.add(threading.get_ident())
        if self._watcher is not None and threading.get_ident() != self._watcher:
            ReadChecker(self).__enter__()

    def _queued_from_here(self) -> None:
        if threading.get_ident() not in self._adopted:
            raise OrderingError(f"device work queued from thread {threading.current_thread().name!r}, which never "
                                "adopted the device (adopt_thread): on a GPU it would go to that thread's current device")

    # streams and events

    def compute_stream(self) -> SimulatedStream:
        return self.compute

    def new_stream(self) -> SimulatedStream:
        stream = SimulatedStream(self, f"stream{len(self.streams)}", threaded=True)
        self.streams.append(stream)
        return stream

    def record(self, stream=None, timing: bool = False) -> SimulatedEvent:
        self._queued_from_here()
        return self._record(stream or self.compute, timing)

    def _record(self, stream: SimulatedStream, timing: bool = False) -> SimulatedEvent:
        event = SimulatedEvent(self, timing)
        event.record(stream)
        return event

    def wait_event(self, stream: SimulatedStream, event: SimulatedEvent) -> None:
        self._queued_from_here()
        if any(skip(stream, event) for skip in self.skipped_waits):
            return
        merge(stream.clock, event.clock)
        if stream is self.compute:
            event._done.wait()
            self.raise_failures()
        else:
            stream.submit(event._done.wait)

    def skip_synchronize(self, event: SimulatedEvent) -> bool:
        return any(skip(event) for skip in self.skipped_synchronizes)

    def host_saw(self, event: SimulatedEvent) -> None:
        """The host waited for event: whatever it does or queues from now on (compute included) comes after."""
        merge(self.host_clock, event.clock)
        merge(self.compute.clock, event.clock)

    def synchronize(self, stream=None) -> None:
        """From any thread: a GPU's synchronize names its device or stream, whichever device is current."""
        for s in [stream] if stream is not None else self.streams:
            self._record(s).synchronize()

    def raise_failures(self) -> None:
        if self.failures:
            raise self.failures[0]

    # memory

    def empty(self, nbytes: int) -> torch.Tensor:
        self._queued_from_here()
        buffer = aligned_empty(nbytes)
        self._track_device(buffer, nbytes)
        return buffer

    def to_device(self, host: torch.Tensor, stream) -> torch.Tensor:
        target = torch.empty_like(host, memory_format=torch.contiguous_format)
        self._track_device(target, target.nbytes)
        self.copy(target, host, stream)
        return target

    def _track_device(self, tensor: torch.Tensor, nbytes: int) -> None:
        address = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._buffers[address] = BufferRecord()
            self._copies_from.pop(address, None)  # an address freed and handed out again
            self._written_by.pop(address, None)
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
        weakref.finalize(tensor.untyped_storage(), self._free_device, address, nbytes)  # with its last view

    def _free_device(self, address: int, nbytes: int) -> None:
        with self._lock:
            self._buffers.pop(address, None)
            self.allocated -= nbytes

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        buffer = aligned_empty(nbytes)
        cost = self.pinned_cost(nbytes)
        address = buffer.untyped_storage().data_ptr()
        with self._lock:
            self._copies_from.pop(address, None)
            self._written_by.pop(address, None)
            self._pinned.add(address)
            self.pinned += cost
            self.peak_pinned = max(self.peak_pinned, self.pinned)
        weakref.finalize(buffer.untyped_storage(), self._free_pinned, address, cost)  # with its last view
        return buffer

    def adopt_host(self, array, mapping) -> torch.Tensor:
        tensor = super().adopt_host(array, mapping)
        address = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._copies_from.pop(address, None)
            self._written_by.pop(address, None)
            self._pinned.add(address)
            self.adopted += tensor.nbytes
        weakref.finalize(tensor.untyped_storage(), self._pinned.discard, address)
        return tensor

    def _free_pinned(self, address: int, cost: int) -> None:
        with self._lock:
            self._pinned.discard(address)
            self.pinned -= cost

    def pinned_cost(self, nbytes: int) -> int:
        return 1 << max(nbytes - 1, 0).bit_length()

    def memory(self) -> tuple[int, int]:
        return self.memory_bytes - self.allocated, self.memory_bytes

    def peak_allocated(self) -> int:
        return self.peak

    # copies and the ledger

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimulatedStream) -> None:
        self._queued_from_here()
        if not {dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()} & self._pinned:
            raise PageableCopyError(f"a copy on {stream} between the device and pageable host memory: a GPU would "
                                    "block the host on it (allocate the host side with pinned_empty)")
        record = self._buffers.get(dst.untyped_storage().data_ptr())
        epoch = stream.epoch()
        if record is not None:
            if record.last_read > stream.clock.get("compute", -1):
                raise OrderingError(
                    f"a copy on {stream} into a device buffer is not ordered after compute's last read of it "
                    f"(compute epoch {record.last_read}, the copy has seen {stream.clock.get('compute', -1)})"
                )
            record.last_copy = (stream.name, epoch)
            self._all_copies.append((stream.name, epoch))
        source = src.untyped_storage().data_ptr()
        writer = self._written_by.get(source)
        if writer is not None and writer[0] != stream.name and stream.clock.get(writer[0], -1) < writer[1]:
            raise OrderingError(f"a copy on {stream} reads a buffer before the copy on {writer[0]} that writes it")
        self._copies_from.setdefault(source, []).append((stream.name, epoch))
        self._written_by[dst.untyped_storage().data_ptr()] = (stream.name, epoch)
        stream.submit(self._landing(dst, src, stream is not self.compute))

    def _landing(self, dst: torch.Tensor, src: torch.Tensor, delayed: bool):
        delay = self.random.uniform(0, self.max_delay_s) if delayed else 0.0
        pauses = [self.random.uniform(0, self.max_delay_s / self.chunks) if delayed else 0.0 for _ in range(self.chunks)]

        def land() -> None:
            time.sleep(delay)
            if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype:
                flat_dst, flat_src = dst.view(-1), src.reshape(-1)
                step = -(-flat_dst.numel() // self.chunks) or 1
                for k, start in enumerate(range(0, flat_dst.numel(), step)):
                    flat_dst[start:start + step].copy_(flat_src[start:start + step])
                    time.sleep(pauses[k])
            else:
                dst.copy_(src)

        return land

    def read(self, tensor: torch.Tensor) -> None:
        """Compute reads tensor: if it lies in a device buffer, that buffer's copy must come first."""
        record = self._buffers.get(tensor.untyped_storage().data_ptr())
        if record is None:
            return
        if record.last_copy is not None:
            stream, epoch = record.last_copy
            if self.compute.clock.get(stream, -1) < epoch:
                raise OrderingError(f"compute reads a device buffer before the copy on {stream} that fills it (no wait for its event)")
        record.last_read = self.compute.epoch()

    def engine_writes(self, host: torch.Tensor) -> None:
        """The I/O engine is about to write into host: every copy reading it must be seen finished."""
        for stream, epoch in self._copies_from.get(host.untyped_storage().data_ptr(), []):
            if self.host_clock.get(stream, -1) < epoch and stream != "compute":
                raise OrderingError(f"the engine reads into a host buffer while a copy from it on {stream} may be in flight")

    def compute_after_copies(self) -> bool:
        """Whether compute is ordered after every copy into device memory queued so far."""
        return all(self.compute.clock.get(stream, -1) >= epoch for stream, epoch in self._all_copies)

    @contextmanager
    def watching(self):
        """Checks every compute read of device memory and every engine write into host memory."""
        original_submit = IoEngine.submit
        device = self

        def submit(engine, path, dst, file_offset=0):
            device.engine_writes(dst)
            return original_submit(engine, path, dst, file_offset)

        IoEngine.submit = submit
        self._watcher = threading.get_ident()
        try:
            with ReadChecker(self):
                yield self
        finally:
            IoEngine.submit = original_submit
            self._watcher = None
        self.synchronize()


class ReadChecker(TorchDispatchMode):
    """Sees every tensor operation compute runs and tells the device which tensors it reads."""

    def __init__(self, device: SimulatedDevice):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:  # a view reads nothing: the runtime slices buffers to queue copies into them
            return func(*args, **(kwargs or {}))
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                self.device.read(leaf)
        return func(*args, **(kwargs or {}))
