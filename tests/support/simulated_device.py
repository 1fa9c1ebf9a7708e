"""A simulated asynchronous device, so that zerolite's CUDA ordering runs, and can fail, on a CPU.

    device = SimulatedDevice(seed=0, memory_bytes=1 << 30)
    with device.watching():                        # the ledger checks every read of device memory
        lm = zerolite.load(layout, device=device)
        lm.generate(...)

Device memory is separate CPU tensors, so every copy really happens. The compute stream is the
calling thread: work runs as it is queued, but its events complete after a random lag on a timer
thread, as a GPU runs behind the host. Every other stream is a worker thread running its queue in
order; a copy lands in chunks after a seeded random delay, so compute that reads a buffer before its
copy has landed sees wrong bytes. elapsed_time raises, as CUDA's does, unless both events were made
for timing and are done (the host must have synchronized them).

A happens-before ledger (vector clocks, assigned when work is queued, as CUDA orders it) keeps, for
every storage and byte range, who last touched it, and raises OrderingError at the first break of:
  - a copy into device memory is ordered after compute's last read or write of those bytes;
  - compute reads device bytes only after the copies that filled them (it waited for their
    events); kernels that read a stack of experts by index (grouped_mm, index) read only the rows
    routed to, as on a GPU, so an unrouted expert may still be landing;
  - a copy reads bytes only after the copy on another stream that wrote them, and after compute's
    write of them (K/V appends wait for the attention that made the keys);
  - the engine reads into host bytes only once the host has seen every copy from them finish.
The caching allocator's rules too: device memory comes from the pool of the stream that allocated
it (empty: compute's), so a copy on another stream writes it only once ordered after the
allocation; memory used on a stream other than its own and freed is reused at once, so that use
must be ordered before its own stream's next work, seen by the host, or kept alive (keep_alive,
record_stream); pinned memory freed while a copy of it is unseen is freed under the copy.
compute_after_copies() checks one more at teardown: compute is ordered after every copy queued.
Every copy's host side must be pinned (pinned_empty, adopt_host), or PageableCopyError: CUDA runs a
copy from pageable memory synchronously, the host blocked, and the overlap is gone.
Device work (an allocation, a copy, an event, a wait) queued from a thread that never called
adopt_thread raises OrderingError: on a GPU it would go to that thread's current device, GPU 0.
Under watching(), each adopted thread's compute reads are checked as the watching thread's are.

Free device memory comes from a configured total; pinned host allocations are counted as the real
device counts them (Device.pinned_cost: page-rounded, not torch's powers of two).
"""

from __future__ import annotations

import queue
import random
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.modeling_utils import ModuleUtilsMixin

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
        if stream is self.device.compute:
            self.device.lag.complete_later(self)  # the work before it runs at once, but the GPU lags the host
        else:
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


class Lag:
    """Completes compute's events in order, each a random while after it was recorded, on a timer
    thread: the host runs ahead of the GPU, so an event it did not wait for is not done yet."""

    def __init__(self, device: SimulatedDevice):
        self.device = device
        self._queue: queue.Queue = queue.Queue()
        self._last_due = 0.0
        threading.Thread(target=self._run, name="sim-lag", daemon=True).start()

    def complete_later(self, event: SimulatedEvent) -> None:
        due = max(self._last_due, time.perf_counter() + self.device.random.uniform(0, self.device.max_delay_s))
        self._last_due = due
        self._queue.put((due, event))

    def _run(self) -> None:
        while True:
            due, event = self._queue.get()
            time.sleep(max(due - time.perf_counter(), 0.0))
            event._complete()


def merge(into: dict[str, int], other: dict[str, int]) -> None:
    for name, epoch in other.items():
        into[name] = max(into.get(name, -1), epoch)


def extent(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of what a view spans in its storage; None if it spans nothing."""
    if tensor.numel() == 0:
        return None
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    return tensor.untyped_storage().data_ptr(), first, first + (last + 1) * size


def overlapping(accesses: dict, start: int, end: int):
    """The entries of {(start, end, ...): epoch} whose bytes meet [start, end)."""
    return [(key, epoch) for key, epoch in accesses.items() if key[0] < end and start < key[1]]


class BufferRecord:
    """What the ledger knows of one storage, by byte range: device memory, pinned host memory, or a
    tensor compute made that a copy then read. Each access map is {(start, end, stream): epoch}:
    the latest epoch of that stream's queue at which it touched those bytes."""

    def __init__(self, allocated: tuple[str, int] | None, pinned: bool = False):
        self.allocated = allocated      # (stream, epoch) whose memory pool it came from; None: host memory
        self.pinned = pinned
        self.copied_in: dict = {}       # copies that wrote these bytes
        self.copied_out: dict = {}      # copies that read them
        self.computed: dict = {}        # compute's reads and writes, {(start, end, "compute"): epoch}
        self.written: dict = {}         # compute's writes alone
        self.used_on: dict[str, int] = {}  # streams other than the allocating one -> their last use
        self.kept_for: set[str] = set()    # streams keep_alive (record_stream) named

    def used(self, stream: str, epoch: int) -> None:
        if self.allocated is not None and stream != self.allocated[0]:
            self.used_on[stream] = max(self.used_on.get(stream, -1), epoch)

    @staticmethod
    def note(accesses: dict, start: int, end: int, stream: str, epoch: int) -> None:
        key = (start, end, stream)
        accesses[key] = max(accesses.get(key, -1), epoch)

    @staticmethod
    def overwritten(accesses: dict, start: int, end: int) -> None:
        """Forgets the entries a new write of [start, end) covers whole (the ledger stays as small as
        the buffer's uses)."""
        for key in [key for key in accesses if start <= key[0] and key[1] <= end]:
            del accesses[key]


class SimulatedDevice(Device):
    separate_memory = True

    def __init__(self, seed: int = 0, memory_bytes: int = 8 << 30, max_delay_s: float = 0.002, chunks: int = 4,
                 reports_cuda: bool = False):
        """reports_cuda: under watching(), models say they are on "cuda" to transformers, so the code
        it runs only on a GPU runs here too (see reporting_cuda)."""
        self.reports_cuda = reports_cuda
        self.name = "sim"
        self.torch_device = torch.device("cpu")
        self.memory_bytes = memory_bytes
        self.max_delay_s = max_delay_s
        self.chunks = chunks
        self.random = random.Random(seed)
        self.failures: list[BaseException] = []
        self.compute = SimulatedStream(self, "compute", threaded=False)
        self.lag = Lag(self)
        # What the host has seen finish (synchronize). Apart from compute's clock: compute
        # waiting for an event on the device tells the host nothing, even though here the calling
        # thread is what waits.
        self.host_clock: dict[str, int] = {}
        self.streams = [self.compute]
        self._records: dict[int, BufferRecord] = {}    # storage address -> what the ledger knows of it
        self._made_by_compute: dict[int, int] = {}     # storage address -> compute's epoch when it made it
        self._all_copies: list[tuple[str, int]] = []
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
            if self.reports_cuda:
                CudaOnCpu().__enter__()

    def _queued_from_here(self) -> None:
        if threading.get_ident() not in self._adopted:
            raise OrderingError(f"device work queued from thread {threading.current_thread().name!r}, which never "
                                "adopted the device (adopt_thread): on a GPU it would go to that thread's current "
                                "device")

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

    # memory, and the caching allocator's rules

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device memory from the compute stream's pool (the calling thread's current stream, as torch's)."""
        self._queued_from_here()
        buffer = aligned_empty(nbytes)
        self._track(buffer, BufferRecord(("compute", self.compute.epoch())), nbytes)
        return buffer

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        buffer = aligned_empty(nbytes)
        cost = self.pinned_cost(nbytes)
        self._track(buffer, BufferRecord(None, pinned=True), 0, cost)
        return buffer

    def adopt_host(self, array, mapping, starts=(0,)) -> torch.Tensor:
        tensor = super().adopt_host(array, mapping, starts)
        self._track(tensor, BufferRecord(None, pinned=True), 0)
        self.adopted += tensor.nbytes
        return tensor

    def _track(self, tensor: torch.Tensor, record: BufferRecord, nbytes: int, pinned_cost: int = 0) -> None:
        address = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._records[address] = record  # an address freed and handed out again starts afresh
            self._made_by_compute.pop(address, None)
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
            self.pinned += pinned_cost
            self.peak_pinned = max(self.peak_pinned, self.pinned)
        # freed with its last view
        weakref.finalize(tensor.untyped_storage(), self._free, address, record, nbytes, pinned_cost)

    def _free(self, address: int, record: BufferRecord, nbytes: int, pinned_cost: int) -> None:
        """The allocator takes the memory back: a GPU would hand it out again at once, so every use of it
        must be ordered before the next user's, or kept alive (record_stream) for its stream."""
        with self._lock:
            if self._records.get(address) is record:
                del self._records[address]
            self.allocated -= nbytes
            self.pinned -= pinned_cost
        if record.pinned:
            for (_, _, stream), epoch in [*record.copied_in.items(), *record.copied_out.items()]:
                if self.host_clock.get(stream, -1) < epoch:
                    self.failures.append(OrderingError(
                        f"pinned host memory freed while a copy on {stream} may still use it: "
                        "synchronize that copy first"))
                    return
            return
        owner = record.allocated[0]
        for stream, epoch in record.used_on.items():
            ordered = self._stream(owner).clock.get(stream, -1) >= epoch or self.host_clock.get(stream, -1) >= epoch
            if stream not in record.kept_for and not ordered:
                self.failures.append(OrderingError(
                    f"device memory from {owner}'s pool, used on {stream}, freed without keep_alive for {stream}: "
                    f"{owner} may reuse it while {stream} still does"))
                return

    def _stream(self, name: str) -> SimulatedStream:
        return next(stream for stream in self.streams if stream.name == name)

    def keep_alive(self, tensor: torch.Tensor, stream: SimulatedStream) -> None:
        self._record_of(tensor).kept_for.add(stream.name)

    def _record_of(self, tensor: torch.Tensor) -> BufferRecord:
        """The ledger's record of tensor's storage; one is opened for a tensor compute made (device
        memory from compute's pool) when a copy or keep_alive first names it."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        record = self._records.get(address)
        if record is None:
            made = self._made_by_compute.pop(address, None)
            record = BufferRecord(("compute", made if made is not None else self.compute.epoch()))
            if made is not None:
                BufferRecord.note(record.written, 0, storage.nbytes(), "compute", made)
            with self._lock:
                self._records[address] = record
            weakref.finalize(storage, self._free, address, record, 0, 0)
        return record

    def memory(self) -> tuple[int, int]:
        return self.memory_bytes - self.allocated, self.memory_bytes

    def peak_allocated(self) -> int:
        return self.peak

    # copies and the ledger

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimulatedStream) -> None:
        self._queued_from_here()
        written, read = self._record_of(dst), self._record_of(src)
        if not (written.pinned or read.pinned):
            raise PageableCopyError(f"a copy on {stream} between the device and pageable host memory: a GPU would "
                                    "block the host on it (allocate the host side with pinned_empty)")
        epoch, seen = stream.epoch(), stream.clock
        target, source = extent(dst), extent(src)
        if target is not None and not written.pinned:
            _, start, end = target
            owner, allocated = written.allocated
            if owner != stream.name and seen.get(owner, -1) < allocated:
                raise OrderingError(f"a copy on {stream} writes device memory from {owner}'s pool before it is ordered "
                                    f"after the allocation ({owner} may still be using what was there)")
            for (_, _, _), last in overlapping(written.computed, start, end):
                if seen.get("compute", -1) < last:
                    raise OrderingError(
                        f"a copy on {stream} into a device buffer is not ordered after compute's last read of it "
                        f"(compute epoch {last}, the copy has seen {seen.get('compute', -1)})")
            BufferRecord.overwritten(written.computed, start, end)
            BufferRecord.overwritten(written.copied_in, start, end)
            BufferRecord.overwritten(written.written, start, end)
            self._all_copies.append((stream.name, epoch))
        if source is not None:
            _, start, end = source
            for (_, _, writer), last in overlapping(read.copied_in, start, end):
                if writer != stream.name and seen.get(writer, -1) < last:
                    raise OrderingError(f"a copy on {stream} reads a buffer before the copy on {writer} that writes it")
            if stream is not self.compute:
                for _, last in overlapping(read.written, start, end):
                    if seen.get("compute", -1) < last:
                        raise OrderingError(f"a copy on {stream} reads device memory before compute's write of it "
                                            "(no wait for compute)")
            BufferRecord.note(read.copied_out, start, end, stream.name, epoch)
            read.used(stream.name, epoch)
        if target is not None:
            BufferRecord.note(written.copied_in, target[1], target[2], stream.name, epoch)
            written.used(stream.name, epoch)
        stream.submit(self._landing(dst, src, stream is not self.compute))

    def _landing(self, dst: torch.Tensor, src: torch.Tensor, delayed: bool):
        delay = self.random.uniform(0, self.max_delay_s) if delayed else 0.0
        pauses = [self.random.uniform(0, self.max_delay_s / self.chunks) if delayed else 0.0
                  for _ in range(self.chunks)]

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
        """Compute reads tensor: if it lies in device memory, the copies that filled those bytes come first."""
        record, span = self._device_record(tensor)
        if record is None:
            return
        _, start, end = span
        for (_, _, stream), last in overlapping(record.copied_in, start, end):
            if stream != "compute" and self.compute.clock.get(stream, -1) < last:
                raise OrderingError(f"compute reads a device buffer before the copy on {stream} that fills it "
                                    "(no wait for its event)")
        epoch = self.compute.epoch()
        BufferRecord.note(record.computed, start, end, "compute", epoch)
        record.used("compute", epoch)

    def wrote(self, tensor: torch.Tensor) -> None:
        """Compute wrote tensor: device memory it made, or bytes of a tracked buffer (an in-place op)."""
        record, span = self._device_record(tensor)
        if span is None:
            return
        if record is None:
            self._made_by_compute[span[0]] = self.compute.epoch()
            return
        _, start, end = span
        epoch = self.compute.epoch()
        BufferRecord.note(record.computed, start, end, "compute", epoch)
        BufferRecord.note(record.written, start, end, "compute", epoch)
        record.used("compute", epoch)

    def _device_record(self, tensor: torch.Tensor):
        span = extent(tensor)
        if span is None:
            return None, None
        record = self._records.get(span[0])
        if record is not None and record.pinned:  # the host's own memory: the host reads and writes it at once
            return None, None
        return record, span

    def engine_writes(self, host: torch.Tensor) -> None:
        """The I/O engine is about to write into host: every copy reading those bytes must be seen finished."""
        span = extent(host)
        record = self._records.get(span[0]) if span is not None else None
        if record is None:
            return
        for (_, _, stream), epoch in overlapping(record.copied_out, span[1], span[2]):
            if self.host_clock.get(stream, -1) < epoch and stream != "compute":
                raise OrderingError(f"the engine reads into a host buffer while a copy from it on {stream} "
                                    "may be in flight")

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
            with ReadChecker(self), reporting_cuda() if self.reports_cuda else nullcontext():
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
        narrowed = rows_read(func, args, kwargs or {})
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                for part in narrowed.get(id(leaf), [leaf]):
                    self.device.read(part)
        result = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(result):  # what it made, or wrote in place (an in-place op returns its target)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                self.device.wrote(leaf)
        return result


def rows_read(func, args, kwargs) -> dict[int, list[torch.Tensor]]:
    """{id(argument): the rows it reads} for kernels that read a stack of experts by index, so the
    ledger checks the experts routed to, as a GPU reads them, not the whole stack: a copy of an
    expert no token was routed to may still be landing in its own rows. Meta tensors (a probe of the
    model's shapes) hold no rows to read."""
    if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in tree_leaves(args)):
        return {}
    if func is torch.ops.aten._grouped_mm.default:
        weights = args[1]
        offsets = args[2] if len(args) > 2 else kwargs.get("offs")
        if offsets is not None and weights.dim() == 3:
            ends = offsets.tolist()
            return {id(weights): [weights[e] for e, (start, end) in enumerate(zip([0, *ends], ends)) if end > start]}
    if func is torch.ops.aten.index.Tensor:
        source, indices = args[0], args[1]
        if indices and indices[0] is not None and not indices[0].dtype.is_floating_point \
                and indices[0].dtype != torch.bool and all(index is None for index in indices[1:]):
            return {id(source): [source[row] for row in sorted(set(indices[0].flatten().tolist()))]}
    return {}


CUDA = torch.device("cuda", 0)  # made here: under CudaOnCpu, torch.device("cuda") would give the CPU


@contextmanager
def reporting_cuda():
    """Every transformers model says it is on "cuda" (ModuleUtilsMixin.device), so generate takes its
    GPU branches (the experts' decode-time kernel swap, moving inputs to the model's device, ...),
    and what those branches ask for on "cuda" is made on the CPU (CudaOnCpu), where the tensors live."""
    original = ModuleUtilsMixin.device
    ModuleUtilsMixin.device = property(lambda model: CUDA)
    try:
        with CudaOnCpu():
            yield
    finally:
        ModuleUtilsMixin.device = original


class CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on "cuda" are made on the CPU, and pinned memory asked for is not pinned
    (a CPU build of torch has no accelerator to pin for)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(on_cpu(arg) for arg in args)
        kwargs = {name: False if name == "pin_memory" else on_cpu(value) for name, value in (kwargs or {}).items()}
        return func(*args, **kwargs)


def on_cpu(value):
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value
