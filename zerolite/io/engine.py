"""The Python face of the C++ I/O engine: aligned buffers, and reads that are submitted and waited for.

    engine = IoEngine()
    buffer = aligned_empty(nbytes)
    ticket = engine.submit("weights.bin", buffer, file_offset=0)
    ...                                   # compute while the read is in flight
    engine.wait(ticket)                   # or engine.cancel(ticket) first: bytes not read yet never are
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import torch

from zerolite import _engine
from zerolite.errors import ZeroliteError

ALIGNMENT = 4096
"""O_DIRECT needs buffer address, file offset and length aligned to the device's block size."""

HUGE_PAGE = 2 << 20
"""Buffers this large or larger get memory of their own in transparent huge pages (host_mapping)."""

ShortReadError = _engine.ShortReadError

FAULT_VARIABLE = "ZEROLITE_INJECT_IO_FAULT"
"""For tests of the error paths: "eio@N" makes the Nth chunk read of each engine fail with EIO,
"short@N" end as if the file did."""


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def aligned_empty(nbytes: int, huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised uint8 host tensor of nbytes whose first byte is 4 KiB aligned (pinned
    memory for a GPU comes from the device: zerolite.io.device); from HUGE_PAGE bytes on, a mapping
    of its own, in huge pages unless huge_pages is False (see host_mapping: for memory read into
    once, such as a tier loaded from disk, rather than again and again, as a slot is)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes >= HUGE_PAGE:
        return torch.frombuffer(host_mapping(nbytes, huge_pages)[0], dtype=torch.uint8)
    # Over-allocate by one alignment and slice: the view keeps the whole allocation alive.
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip : skip + nbytes]


def host_mapping(nbytes: int, huge_pages: bool = True) -> tuple[ctypes.Array, mmap.mmap]:
    """nbytes of private anonymous memory, 2 MiB aligned and (with huge_pages) advised into
    transparent huge pages, as a ctypes array (which keeps the mapping alive) and the mapping itself.

    Why huge pages: an O_DIRECT read pins every page it lands in, and pinning 4 KiB pages one by
    one costs the kernel more than the read on a fast disk; huge pages leave it 512 times fewer
    pages to pin, which a buffer read into at every step (a slot) gains each time. Why not for
    memory filled once (a CPU's host tier and resident blocks, convert's buffers; a GPU's pinned
    host tier is the device's: zerolite.io.device): where the host backs every fresh page anew (a
    VM with free page reporting), the first touch of a huge page costs far more than its read.
    Matmuls on weights in either kind of page run alike. The figures, measured on the development
    VM: docs/design-figures.md, under zerolite/io/engine.py. Where the kernel gives no huge pages
    the memory works as before.
    """
    rounded = align_up(nbytes, HUGE_PAGE)
    # Private, not the default shared mapping: shmem-backed pages are shared with forked children
    # and get no transparent huge pages.
    mapping = mmap.mmap(-1, rounded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    skip = -start % HUGE_PAGE
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, skip, rounded)
    return (ctypes.c_uint8 * nbytes).from_buffer(mapping, skip), mapping


def host_bytes(nbytes: int) -> int:
    """The host memory aligned_empty(nbytes) really takes."""
    return align_up(nbytes, HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGNMENT)


class IoEngine:
    """Reads byte ranges of files into tensors, many reads in flight, GIL released while it works.

    backend: "io_uring", "pread" (a thread pool, works everywhere) or "auto" (io_uring where the
    kernel allows it). queue_depth reads of chunk_bytes each are kept in flight; a request larger
    than chunk_bytes is split. threads applies to the pread backend (default: queue_depth).
    """

    def __init__(
        self,
        backend: str = "auto",
        queue_depth: int = 32,
        chunk_bytes: int = 1 << 20,
        threads: int = 0,
    ):
        fault, _, fault_at = os.environ.get(FAULT_VARIABLE, "").partition("@")
        self._engine = _engine.Engine(backend, queue_depth, chunk_bytes, threads, fault, int(fault_at or 0))
        # A tensor must outlive the read into it: hold it until its ticket has been waited for.
        self._destinations: dict[int, torch.Tensor] = {}

    @property
    def backend(self) -> str:
        """The backend in use ("io_uring" or "pread"), after "auto" has chosen."""
        return self._engine.backend

    @property
    def queue_depth(self) -> int:
        return self._engine.queue_depth

    @property
    def chunk_bytes(self) -> int:
        return self._engine.chunk_bytes

    def submit(self, path: str | os.PathLike, dst: torch.Tensor, file_offset: int = 0) -> int:
        """Starts reading dst.nbytes bytes of path at file_offset into dst; returns a ticket."""
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError("the read destination must be a contiguous CPU tensor")
        ticket = self._engine.submit(os.fspath(path), dst.data_ptr(), dst.nbytes, file_offset)
        self._destinations[ticket] = dst
        return ticket

    def wait(self, ticket: int, timeout_s: float | None = None) -> float:
        """Blocks until the ticket's bytes have all arrived and returns when the last one did, on
        time.perf_counter()'s clock; raises OSError naming file and offset.

        With timeout_s, raises TimeoutError when the read has not finished by then (the ticket
        stays valid and can be waited for again).
        """
        try:
            finished = self._engine.wait(ticket, -1.0 if timeout_s is None else timeout_s)
        except OSError:
            self._destinations.pop(ticket, None)
            raise
        if finished is None:
            raise TimeoutError(f"read {ticket} has not finished after {timeout_s} s")
        del self._destinations[ticket]
        return finished

    def poll(self, ticket: int) -> float | None:
        """When the ticket's read finished (it is then spent, as after wait), or None while it runs;
        never blocks. Raises OSError as wait does."""
        try:
            finished = self._engine.wait(ticket, 0.0)
        except OSError:
            self._destinations.pop(ticket, None)
            raise
        if finished is not None:
            del self._destinations[ticket]
        return finished

    def cancel(self, ticket: int) -> int:
        """Gives up the ticket's reads that have not started (their bytes never land in dst);
        returns how many bytes that spares. The ticket is still to be waited for: reads under
        way finish, and dst must live until then."""
        return self._engine.cancel(ticket)

    def read(self, path: str | os.PathLike, dst: torch.Tensor, file_offset: int = 0) -> torch.Tensor:
        """Submit and wait in one call, for when there is nothing to overlap."""
        self.wait(self.submit(path, dst, file_offset))
        return dst


def supports_direct_io(path: os.PathLike) -> bool:
    """Whether path's file system takes O_DIRECT opens (older tmpfs and some network ones refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise ZeroliteError(f"cannot open {path}: {e.strerror}") from e
    os.close(fd)
    return True


def pread_into(path: str | os.PathLike, dst: torch.Tensor, file_offset: int) -> int:
    """Reads up to dst.nbytes bytes of path at file_offset into dst (contiguous, on the CPU)
    through the page cache, for the few reads that are no whole aligned pages; returns the bytes
    read, fewer only where the file ends."""
    view, done = memoryview(dst.numpy()).cast("B"), 0
    with open(path, "rb", buffering=0) as f:
        while done < dst.nbytes:
            got = os.preadv(f.fileno(), [view[done:]], file_offset + done)
            if got == 0:
                break
            done += got
    return done
