"""The disk bound of a streamed decode step: the engine reads the streamed blocks in decode order,
through a ring as the executor does, with no compute, one pass per decode step.

    figures = read_pass(layout, plan.on_disk, passes=7, engine=lm.engine, depth=2)
    figures["read_gbps"]    # bytes of one pass / the median pass: what a step could read at best
    figures["pass_s"]       # every pass's seconds, in order

Why not one cold sequential read of the file (zerolite.planner.machine.measure_disk of a file): on
virtual disks the host caches below the guest, so decode's repeated passes over the same blocks can
run much faster than a cold read of the file; a bound taken from that read says a step beats its
own bound. The same reads, repeated the same way, are the bound a step can be held to.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from zerolite.errors import ZeroliteError
from zerolite.io.engine import IoEngine, align_up, aligned_empty
from zerolite.layout.folder import Layout
from zerolite.layout.store import DiskStore


def read_pass(layout: Layout, names, passes: int, engine: IoEngine | None = None, depth: int = 2) -> dict:
    """Reads the blocks names, in that order, passes times over, depth blocks in flight at once."""
    names = list(names)
    if not names:
        raise ZeroliteError("no block is streamed from disk: there is no read pass to measure")
    if passes < 1 or depth < 1:
        raise ZeroliteError(f"a read pass needs at least one pass and one slot, got {passes} passes and {depth} slots")
    disk = DiskStore(layout, engine or IoEngine())  # a store of its own: the run's count of bytes read stays the run's
    slot_bytes = align_up(max(layout.manifest.block(name).length for name in names))
    ring = [aligned_empty(slot_bytes) for _ in range(depth)]
    for buffer in ring:
        buffer.fill_(0)  # fault the pages in now, not inside the timed reads
    in_flight: deque[tuple[int, int]] = deque()  # (position in the order, ticket)
    pass_ends: list[float] = []
    order = [name for _ in range(passes) for name in names]
    started = time.perf_counter()
    try:
        for position, name in enumerate(order):
            if len(in_flight) == depth:
                landed(disk, in_flight, len(names), pass_ends)
            in_flight.append((position, disk.submit(name, ring[position % depth])))
        while in_flight:
            landed(disk, in_flight, len(names), pass_ends)
    finally:
        disk.wait_all([ticket for _, ticket in in_flight])  # no read may outlive the ring it fills
    pass_s = [end - begin for begin, end in zip([started] + pass_ends, pass_ends)]
    per_pass = layout.manifest.nbytes(names)
    median = statistics.median(pass_s)
    return {"bytes_per_pass": per_pass, "passes": passes, "depth": depth, "pass_s": [round(s, 4) for s in pass_s],
            "median_pass_s": round(median, 4), "read_gbps": round(per_pass / median / 1e9, 3),
            "backend": disk.engine.backend}


def landed(disk: DiskStore, in_flight: deque, per_pass: int, pass_ends: list[float]) -> None:
    """Waits for the oldest read; notes when a pass's last block landed."""
    position, ticket = in_flight.popleft()  # spent once waited for, even if the read failed
    finished = disk.wait(ticket)
    if (position + 1) % per_pass == 0:
        pass_ends.append(finished)
