"""K/V on disk (--kv-disk): the chosen layers keep their keys and values in a file each under the
offload root, read whole one layer ahead of use through the I/O engine (O_DIRECT) and appended to
as each step makes new tokens, so that only a layer or two of them are ever in memory and the batch
can grow past host memory as well as device memory.

    disk = KVDisk(root, engine, device)                  # one per model; PartialOffloadCache makes the layers
    layer = DiskLayer(disk, tokens=job_length)

A layer's file is sequence-first: token t is one record at t * record bytes, every row's keys then
every row's values ([batch, heads, width] each, in the states' dtype, or packed rows at --kv-bits 8
and 4), so that appending a step's tokens writes at the end and the prefix read each step is one
extent. Writes are O_DIRECT too, of whole pages: the partial page at the end is kept in memory and
written again, with what follows it, at the next append. Measured on the development VM (32 layer
files, 33 KB appended to each a step, 4 read back whole): an O_DIRECT page write takes 210-250 us,
a buffered write 20 us, but an O_DIRECT read must then flush the dirty pages it covers, which made
each layer's read 0.3-0.6 ms slower, inside the read ahead, and dirty pages are charged to a memory
cgroup until they are written back. So the writes are direct, on a thread of their own, in order,
off compute's path; a layer's read waits only for its own last write, a step old.

The attention code sees exactly the tensors a DynamicCache would give it. What changes a layer's
K/V other than appending (a running batch's rows joining or leaving, a crop, a beam reorder) goes
through .keys and .values: reading them brings the layer's K/V into memory, assigning them
replaces it there, and the next use writes the file anew (a full read and write of the layer,
which static batches never pay).
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.io.engine import ALIGNMENT, IoEngine, align_up, aligned_empty

WRITE_BYTES = 1 << 20  # the most one write covers: its staging buffer is the writer's only one
QUEUED_BYTES = 64 << 20  # the most new K/V waiting for the writer: a long prefill's, layer after layer, would
                         # otherwise pile up in memory faster than the disk takes it
FOLDER_PREFIX = "zerolite-kv-"


class KVFile:
    """One layer's file, written in whole pages from the writer thread; removed from any thread (a
    cache dropped is collected wherever it happens to be), after which the writes still queued for
    it do nothing."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()  # a write in progress, or the removal: never both
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise ZeroliteError(f"cannot make the K/V file {path}: {e.strerror}") from e
            # a file system without O_DIRECT (tmpfs): its reads are buffered too (zerolite.io.engine)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._tail = b""    # the bytes after the last whole page: written again with the next append
        self._tail_at = 0   # where they start in the file (a page boundary)

    def append(self, data: torch.Tensor, scratch: torch.Tensor) -> None:
        """Writes data (contiguous uint8 on the host) at the end, through scratch (aligned, WRITE_BYTES
        and a page): the tail page and as much of data as fills it, page-padded, a write at a time."""
        with self._lock:
            if self._fd >= 0:
                self._append(data, scratch)

    def _append(self, data: torch.Tensor, scratch: torch.Tensor) -> None:
        source = memoryview(data.reshape(-1).numpy())
        staging = memoryview(scratch.numpy())
        done = 0
        while done < len(source):
            kept = len(self._tail)
            piece = min(len(source) - done, WRITE_BYTES - kept)
            staging[:kept] = self._tail
            staging[kept:kept + piece] = source[done:done + piece]
            used = kept + piece
            self._write(staging[:align_up(used)], self._tail_at)
            whole = used - used % ALIGNMENT
            self._tail, self._tail_at = bytes(staging[whole:used]), self._tail_at + whole
            done += piece

    def _write(self, view: memoryview, offset: int) -> None:
        while len(view):
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as e:
                raise ZeroliteError(f"cannot write the K/V file {self.path} at offset {offset}: {e.strerror}") from e
            view, offset = view[written:], offset + written

    def truncate(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.ftruncate(self._fd, 0)
                self._tail, self._tail_at = b"", 0

    def remove(self) -> None:
        """Closes and deletes the file (once; again does nothing)."""
        with self._lock:
            if self._fd < 0:
                return
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)


class StagingPool:
    """Aligned host buffers (pinned where the device has memory of its own) for a layer's read or a
    step's append, each given back with the event after which nothing uses it any more. A request
    larger than every free buffer frees them (every layer's K/V grows alike: they are outgrown)."""

    def __init__(self, allocate):
        self._allocate = allocate
        self._free: list[tuple[torch.Tensor, object]] = []
        self._lock = threading.Lock()  # buffers come back from the writer thread too

    def take(self, nbytes: int, room: int = 0) -> torch.Tensor:
        """A flat uint8 buffer of at least nbytes; one made now holds room bytes, where more is larger."""
        with self._lock:
            fitting = [i for i, (buffer, _) in enumerate(self._free) if buffer.nbytes >= nbytes]
            if fitting:
                buffer, event = self._free.pop(min(fitting, key=lambda i: self._free[i][0].nbytes))
            else:
                outgrown, self._free = self._free, []
        if fitting:
            if event is not None:
                event.synchronize()  # the copy out of it has finished: it may be read into again
            return buffer
        for _, event in outgrown:
            if event is not None:
                event.synchronize()  # not freed under a copy
        return self._allocate(max(nbytes, room))

    def give(self, buffer: torch.Tensor, event=None) -> None:
        with self._lock:
            self._free.append((buffer, event))

    def wait_for_copies(self) -> None:
        """Waits for the copies out of the buffers held, before they may be freed: pinned memory freed
        under a copy is a race (the last step's read, where no write after it waited for compute)."""
        with self._lock:
            for _, event in self._free:
                if event is not None:
                    event.synchronize()
            self._free = [(buffer, None) for buffer, _ in self._free]


class KVDisk:
    """Where one model's K/V files go: a folder of its own under the offload root (made at the first
    file, removed by close or at exit), the engine that reads them, the thread that writes them, and
    the staging buffers. bytes_read and bytes_written count the K/V traffic."""

    def __init__(self, root: Path, engine: IoEngine, device: Device):
        self.root, self.engine, self.device = Path(root), engine, device
        self.reads = StagingPool(device.pinned_empty)
        self.outboxes = StagingPool(device.pinned_empty)  # a step's new tokens on the host (devices apart)
        self.bytes_read = self.bytes_written = 0
        self.folder: Path | None = None
        self._names = itertools.count()
        self._writer: ThreadPoolExecutor | None = None
        self._scratch: torch.Tensor | None = None
        self._failure: BaseException | None = None
        self._queued: deque[tuple[Future, int]] = deque()  # writes not yet seen done, and their bytes

    def new_file(self) -> KVFile:
        if self.folder is None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=self.root))
            except OSError as e:
                raise ZeroliteError(f"cannot make a folder for the K/V files under {self.root}: {e.strerror}") from e
            weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
            # adopted: it waits for copies' events, which on a GPU other than the first are that GPU's
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="zerolite-kv-writer",
                                              initializer=self.device.adopt_thread)
            self._scratch = aligned_empty(WRITE_BYTES + ALIGNMENT)
        return KVFile(self.folder / f"layer-{next(self._names)}.kv")

    def append(self, file: KVFile, data: torch.Tensor, ready=None, outbox: torch.Tensor | None = None) -> Future:
        """Queues data's write at file's end, after the event ready (data's copy to the host); outbox,
        where data lies in one, goes back to its pool once written. Waits first for the oldest writes
        while more than QUEUED_BYTES would be queued."""
        while self._queued and (self._queued[0][0].done()
                                or sum(nbytes for _, nbytes in self._queued) + data.nbytes > QUEUED_BYTES):
            self._queued.popleft()[0].result()
        written = self._writer.submit(self._append, file, data, ready, outbox)
        self._queued.append((written, data.nbytes))
        return written

    def _append(self, file: KVFile, data: torch.Tensor, ready, outbox) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            file.append(data, self._scratch)
            self.bytes_written += data.nbytes
        except BaseException as e:
            self._failure = self._failure or e
            raise
        if outbox is not None:
            self.outboxes.give(outbox)

    def truncate(self, file: KVFile) -> Future:
        return self._writer.submit(file.truncate)

    def discard(self, file: KVFile) -> None:
        """Removes file after the writes queued before (unlinking a file of many pages takes
        milliseconds: the writer's, not the caller's). From any thread: a cache is collected wherever."""
        try:
            self._writer.submit(file.remove)
        except RuntimeError:  # the writer is shut down: nothing is queued any more
            file.remove()

    def wait_for_writes(self) -> None:
        """Waits for every write and removal queued so far (and raises the first that failed)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()
        self.check()

    def check(self) -> None:
        """Raises the first write that failed (it failed on the writer thread)."""
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Waits for the writes queued and the copies out of the read buffers, and removes the folder
        with every file still in it."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.reads.wait_for_copies()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class DiskLayer(DynamicLayer):
    """One layer's K/V in a file of its own (KVDisk); update() hands the attention the whole K/V, as
    DynamicLayer does, from a read started one layer ahead (prefetch)."""

    def __init__(self, disk: KVDisk, tokens: int = 0):
        self._held = None             # (keys, values) brought into memory to be changed (set before the mixin's
                                      # __init__, which assigns keys and values)
        super().__init__()
        self.disk = disk
        self.tokens = tokens          # the job's length where known: the read buffers are made for it
        self.file: KVFile | None = None
        self.length = 0               # tokens in the file
        self._read = None             # (ticket, buffer, length) of the read started ahead of use
        self._written: Future | None = None  # the file's last queued write
        self._token_bytes = (0, 0)    # each token's keys and values, every row
        self._shapes = ((0, 0, 0), (0, 0, 0))  # (batch, heads, width) of the keys and of the values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.file = self.disk.new_file()
        weakref.finalize(self, self.disk.discard, self.file)  # a cache its caller kept, once dropped
        self._take_shapes(key_states, value_states)
        self.is_initialized = True

    def _take_shapes(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._shapes = tuple((batch, heads, width) for batch, heads, _, width in (keys.shape, values.shape))
        self._token_bytes = tuple(batch * heads * width * self.dtype.itemsize for batch, heads, width in self._shapes)

    # keys and values: read whole into memory where a caller looks at them or changes them

    @property
    def keys(self) -> torch.Tensor | None:
        return self._states()[0] if self.is_initialized else None

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._set(0, tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return self._states()[1] if self.is_initialized else None

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._set(1, tensor)

    def _set(self, which: int, tensor: torch.Tensor | None) -> None:
        if tensor is None:  # the mixin's __init__ and reset: nothing held
            self._held = None
            return
        held = list(self._states())
        held[which] = tensor
        self._held = tuple(held)

    def _states(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._held is None:
            self._start_read()
            keys, values, release = self._finish_read()
            if release is not None and not self.disk.device.separate_memory:
                keys, values = keys.clone(), values.clone()  # their own memory: the read buffer goes back
            self._give_back(release)
            self._held = (keys, values)
        return self._held

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self._held[0].shape[-2] if self._held is not None else self.length

    # the step: read ahead, attend, append

    def prefetch(self, extra: int = 0) -> None:
        """Starts reading the layer's K/V (one layer ahead of its attention); extra, the tokens this
        step appends, is the host layers' concern and unused here."""
        if not self.is_initialized or self._read is not None:
            return
        self._store_held()
        self._start_read()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.prefetch()  # a no-op when the cache already started it one layer ahead
        keys, values, release = self._finish_read()
        self._append(key_states, value_states)
        whole = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        self._give_back(release)
        return whole

    def _start_read(self) -> None:
        """1. the file's last write has landed  2. a read of its tokens so far, in whole pages, is submitted."""
        if self.length == 0 or self._read is not None:
            return
        self._wait_written()
        nbytes = align_up(self.length * sum(self._token_bytes))
        # made for the job's length where it is known, else with room to grow into (doubling)
        room = align_up(max(self.tokens, 2 * self.length) * sum(self._token_bytes))
        buffer = self.disk.reads.take(nbytes, room)
        ticket = self.disk.engine.submit(self.file.path, buffer[:nbytes], 0)
        self._read = (ticket, buffer, self.length)

    def _finish_read(self):
        """(keys, values, release): the read started ahead, waited for, as [batch, heads, tokens, width]
        views on the device (copied there on compute's stream where memory is apart); release is what
        _give_back hands back to the pool once they have been used (None: nothing was read)."""
        if self._read is None:
            return (*(torch.empty((batch, heads, 0, width), dtype=self.dtype, device=self.device)
                      for batch, heads, width in self._shapes), None)
        ticket, buffer, length = self._read
        self._read = None
        self.disk.engine.wait(ticket)
        nbytes = length * sum(self._token_bytes)
        self.disk.bytes_read += nbytes
        records, event = buffer[:nbytes], None
        device = self.disk.device
        if device.separate_memory:
            target = device.empty(nbytes)
            device.copy(target, records, device.compute_stream())
            records, event = target, device.record()
        records = records.view(length, -1)
        key_bytes = self._token_bytes[0]
        keys, values = ((part.view(self.dtype).view(length, *shape).permute(1, 2, 0, 3))
                        for part, shape in zip((records[:, :key_bytes], records[:, key_bytes:]), self._shapes))
        return keys, values, (buffer, event)

    def _give_back(self, release) -> None:
        if release is not None:
            self.disk.reads.give(*release)

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Queues the write of the new tokens' records (a copy to the host first where memory is apart)."""
        extra = keys.shape[-2]
        if extra == 0 or keys.shape[0] == 0:
            return
        records = torch.cat([states.permute(2, 0, 1, 3).reshape(extra, -1).view(torch.uint8)
                             for states in (keys, values)], dim=1).view(-1)
        device = self.disk.device
        if device.separate_memory:
            outbox = self.disk.outboxes.take(records.nbytes)
            device.copy(outbox[:records.nbytes], records, device.compute_stream())
            self._written = self.disk.append(self.file, outbox[:records.nbytes], device.record(), outbox)
        else:
            self._written = self.disk.append(self.file, records)
        self.length += extra

    def _wait_written(self) -> None:
        if self._written is not None:
            self._written.result()
            self._written = None
        self.disk.check()

    def _store_held(self) -> None:
        """K/V changed in memory (a running batch's rows, a crop) are written as the file anew."""
        if self._held is None:
            return
        keys, values = self._held
        self._held = None
        self._take_shapes(keys, values)
        self._written = self.disk.truncate(self.file)
        self.length = 0
        self._append(keys, values)

    def wait_for_copies(self) -> None:
        """Waits for a read still in flight (dropped: its buffer goes back), before the layer is changed or reset."""
        if self._read is not None:
            ticket, buffer, _ = self._read
            self._read = None
            self.disk.engine.wait(ticket)
            self.disk.reads.give(buffer)

    def reset(self) -> None:
        """Empties the layer and removes its file."""
        self.wait_for_copies()
        if self.file is not None:
            self.disk.discard(self.file)
        self.file, self.length, self._held, self._written = None, 0, None, None
        super().reset()
