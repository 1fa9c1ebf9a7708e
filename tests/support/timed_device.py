"""The simulated device with a virtual clock: how long a step would take on a GPU, and how busy its
host-to-device link would be, with zerolite's own executor queueing the work.

    timed = TimedDevice(H100)                    # rates measured on an H100 (docs/gpu/)
    timed.scale[stream.name] = 1.71e9 / n        # a copy on stream of n bytes stands for a 70B layer's
    with timed.watching():                       # the ordering ledger checks everything, as ever
        lm = zerolite.load(layout, device=timed)
        timed.kernel(flops=..., nbytes=...)      # a kernel's modelled time, queued on compute
        ...
    timed.busy("h2d", start, end)                # the link's busy share over a span of virtual time

Everything runs as on the plain simulated device (SimulatedDevice: real bytes, real ordering
checks); beside it, each piece of work is given a start and an end on one virtual clock, when it
is queued, as the hardware would run it:
  - the host's time moves only when it waits: an event's or a stream's synchronize, a read from
    disk waited for, a scalar read off the device (.item(), a bool() of a device tensor), or (with
    launch_queue) a kernel queued while the compute stream already holds that many unfinished;
    each wait is kept in waits, with its kind and how long the host was blocked
  - a stream's work runs in the order queued, after the host queued it and after the events the
    stream was told to wait for
  - engines run one piece of work at a time, in the order it reached them: one copy engine for
    host-to-device copies (whatever stream they are on: slots' and K/V fetches' share the link),
    one for device-to-host (K/V appends), one compute engine, and the disk, which the I/O engine's
    reads queue on at its rate
  - a copy takes its modelled bytes (its bytes times its stream's scale) over its link's rate; a
    kernel max(FLOPs over the FLOP rate, bytes over the memory's rate); a disk read its modelled
    bytes over the disk's rate; queueing costs the host nothing
A read the engine finished (in real time) is not seen finished by a poll until the virtual clock
has passed its end: the copy after it is queued when the host would know of it on a GPU.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.simulated_device import SimulatedDevice, SimulatedEvent, SimulatedStream
from zerolite.io.engine import IoEngine

SCALARS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)


@dataclass(frozen=True)
class Rates:
    h2d_gbps: float          # pinned host memory to the device
    d2h_gbps: float          # the device to pinned host memory
    disk_gbps: float         # the I/O engine's reads
    tflops: float            # dense bf16 matmuls at a large batch
    memory_gbps: float       # the device's own memory, as a small-batch matmul streams its weight


# An H100 80GB HBM3 (docs/gpu/, 2026-11): pinned H2D 53.3 GB/s at a 1.71 GB layer; an 8192 x 28672
# bf16 matmul in 0.17 ms at 1 to 64 rows (470 MB of weight: 2.76 TB/s). D2H taken equal to H2D; the
# FLOP rate is not measured there (H100 SXM's dense bf16 is 989 TFLOPS on paper; 700 is what large
# cuBLAS GEMMs reach); the disk's rate is a PCIe 4 NVMe's.
H100 = Rates(h2d_gbps=53.3, d2h_gbps=53.3, disk_gbps=7.0, tflops=700.0, memory_gbps=2760.0)

H2D, D2H, COMPUTE, DISK = "h2d", "d2h", "compute", "disk"


@dataclass(frozen=True)
class Wait:
    kind: str        # "event" (a synchronize), "disk" (a read waited for), "scalar" (a read off the device), "launch"
    at: float        # the host's time when it began to wait
    until: float     # ... and when it went on (at, where what it waited for was done already)

    @property
    def blocked_s(self) -> float:
        return self.until - self.at


class TimedDevice(SimulatedDevice):
    def __init__(self, rates: Rates, seed: int = 0, memory_bytes: int = 8 << 30, reports_cuda: bool = True,
                 disk_scale: float = 1.0, launch_queue: int | None = None):
        """disk_scale: the modelled bytes of each byte the I/O engine reads (set it with the copies'
        scale, so a block read from disk weighs what its copy does). launch_queue: the modelled
        kernels the compute stream holds unfinished before queueing one more blocks the host, as
        CUDA's launch queue does at about a thousand launches (None: never)."""
        super().__init__(seed=seed, memory_bytes=memory_bytes, max_delay_s=0.0, reports_cuda=reports_cuda)
        self.rates = rates
        self.now = 0.0                                   # the host's virtual time
        self.scale: dict[str, float] = {}                # stream name -> modelled bytes per byte copied (default 1)
        self.disk_scale = disk_scale
        self._ends: dict[str, float] = {COMPUTE: 0.0}    # stream -> when its work queued so far ends
        self._engine_free = {H2D: 0.0, D2H: 0.0, COMPUTE: 0.0, DISK: 0.0}
        self.work: dict[str, list[tuple[float, float]]] = {H2D: [], D2H: [], COMPUTE: [], DISK: []}
        self._reads: dict[int, float] = {}               # engine ticket -> when its read ends
        self.waits: list[Wait] = []                      # every time the host waited, in order
        self.launch_queue = launch_queue
        self._launched: deque[float] = deque()           # the ends of the kernels queued on compute, oldest first

    # the clock

    def _queue(self, engine: str | None, stream: SimulatedStream, seconds: float) -> None:
        """Work of seconds on engine, queued on stream now."""
        start = max(self.now, self._ends.get(stream.name, 0.0), self._engine_free[engine] if engine else 0.0)
        end = start + seconds
        self._ends[stream.name] = end
        if engine:
            self._engine_free[engine] = end
            self.work[engine].append((start, end))

    def _wait_for(self, until: float, kind: str) -> None:
        self.waits.append(Wait(kind, self.now, max(self.now, until)))
        self.now = max(self.now, until)

    def blocked(self, start: float, end: float, kinds=("event", "scalar", "launch")) -> list[Wait]:
        """The waits of these kinds that began in [start, end) and blocked the host."""
        return [w for w in self.waits if w.kind in kinds and start <= w.at < end and w.blocked_s > 0]

    def kernel(self, flops: float = 0.0, nbytes: float = 0.0) -> None:
        """A kernel's modelled time on the compute stream: the slower of its FLOPs and its memory traffic."""
        if self.launch_queue is not None:
            while self._launched and self._launched[0] <= self.now:
                self._launched.popleft()
            if len(self._launched) >= self.launch_queue:
                self._wait_for(self._launched[-self.launch_queue], "launch")
        self._queue(COMPUTE, self.compute,
                    max(flops / (self.rates.tflops * 1e12), nbytes / (self.rates.memory_gbps * 1e9)))
        if self.launch_queue is not None:
            self._launched.append(self._ends[COMPUTE])

    def busy(self, engine: str, start: float, end: float) -> float:
        """The share of [start, end) engine was working."""
        covered = sum(max(min(b, end) - max(a, start), 0.0) for a, b in self.work[engine])
        return covered / max(end - start, 1e-12)

    def compute_end(self) -> float:
        """When the compute queued so far ends."""
        return self._ends[COMPUTE]

    # the device, timed

    def _record(self, stream: SimulatedStream, timing: bool = False) -> SimulatedEvent:
        event = super()._record(stream, timing)
        event.at = self._ends.get(stream.name, 0.0)
        return event

    def wait_event(self, stream: SimulatedStream, event: SimulatedEvent) -> None:
        if not any(skip(stream, event) for skip in self.skipped_waits):
            self._ends[stream.name] = max(self._ends.get(stream.name, 0.0), getattr(event, "at", 0.0))
        super().wait_event(stream, event)

    def host_saw(self, event: SimulatedEvent) -> None:
        self._wait_for(getattr(event, "at", 0.0), "event")
        super().host_saw(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimulatedStream) -> None:
        super().copy(dst, src, stream)
        into_host, from_host = self._pinned(dst), self._pinned(src)
        nbytes = dst.numel() * dst.element_size() * self.scale.get(stream.name, 1.0)
        if from_host and not into_host:
            self._queue(H2D, stream, nbytes / (self.rates.h2d_gbps * 1e9))
        elif into_host and not from_host:
            self._queue(D2H, stream, nbytes / (self.rates.d2h_gbps * 1e9))
        else:
            self._queue(None, stream, 2 * nbytes / (self.rates.memory_gbps * 1e9))

    def _pinned(self, tensor: torch.Tensor) -> bool:
        record = self._records.get(tensor.untyped_storage().data_ptr())
        return record is not None and record.pinned

    # the disk and the host's reads of the device

    @contextmanager
    def watching(self):
        device = self
        submit, wait, poll = IoEngine.submit, IoEngine.wait, IoEngine.poll

        def timed_submit(engine, path, dst, file_offset=0):
            ticket = submit(engine, path, dst, file_offset)
            start = max(device.now, device._engine_free[DISK])
            read_s = dst.nbytes * device.disk_scale / (device.rates.disk_gbps * 1e9)
            device._engine_free[DISK] = device._reads[ticket] = start + read_s
            device.work[DISK].append((start, device._engine_free[DISK]))
            return ticket

        def timed_wait(engine, ticket, timeout_s=None):
            finished = wait(engine, ticket, timeout_s)
            device._wait_for(device._reads.pop(ticket, 0.0), "disk")
            return finished

        def timed_poll(engine, ticket):
            if device._reads.get(ticket, 0.0) > device.now:
                return None  # not finished yet on the virtual clock
            return timed_wait(engine, ticket)  # finished there: the real read (tiny) is waited for

        IoEngine.submit, IoEngine.wait, IoEngine.poll = timed_submit, timed_wait, timed_poll
        try:
            with super().watching(), ScalarReads(self):
                yield self
        finally:
            IoEngine.submit, IoEngine.wait, IoEngine.poll = submit, wait, poll


class ScalarReads(TorchDispatchMode):
    """A scalar read off a device tensor (.item(), bool(), equal) makes the host wait for compute,
    as on a GPU; a host tensor's (pinned memory) does not."""

    def __init__(self, device: TimedDevice):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALARS and not self.device._pinned(args[0]):
            self.device._wait_for(self.device.compute_end(), "scalar")
        return func(*args, **(kwargs or {}))
