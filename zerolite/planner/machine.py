"""Measuring the machine: how fast the disk under a layout reads, and how fast pinned memory reaches the GPU.

    disk = measure_disk("/nvme/bloom")        # a layout, a file, or a folder (a scratch file is written there)
    disk["read_gbps"]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.io.engine import ALIGNMENT, IoEngine, aligned_empty
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import MANIFEST
from zerolite.layout.read_pass import read_pass
from zerolite.planner import measurements
from zerolite.runtime.plan import spread

REQUEST_BYTES = 64 << 20     # each submit; several in flight, as the executor keeps whole blocks in flight
REQUESTS_IN_FLIGHT = 4
SCRATCH_NAME = ".zerolite-disk-probe"
DISK_READ_BYTES = 4 << 30    # read at most this much of a file: long enough to see past caches and bursts
LAYOUT_PASSES = 3            # read-only passes over a layout's layers


def measure_disk(path: str | os.PathLike, max_bytes: int = DISK_READ_BYTES, scratch_bytes: int = 2 << 30,
                 engine: IoEngine | None = None) -> dict:
    """Sequential O_DIRECT read bandwidth through the engine, in GB/s (decimal).

    path is a layout (its layers read as decode reads them: LAYOUT_PASSES read-only passes in
    layer order over at most max_bytes in all, the median pass's rate), a file (read once up to
    max_bytes), or a folder: a scratch file of
    scratch_bytes is written there, kept out of the page cache, read and removed. A layout's
    rate is the one a decode step's reads see: on a virtual disk whose host caches it below the
    guest, passes after the first run faster than a single cold read (docs/design-figures.md,
    under zerolite/planner/machine.py).
    """
    target = Path(path).expanduser()
    if not target.exists():
        raise ZeroliteError(f"`disk` {target} does not exist: give a layout, a file or a folder on the disk to measure")
    engine = engine or IoEngine()
    if read_bytes(target, max_bytes, scratch_bytes) >= measurements.DISK_RECORDED_BYTES:
        # Only for a read long enough to be recorded: a short one's rate serves this plan alone, and
        # dropping every file's cached pages for it would slow the whole machine at each plan.
        drop_page_cache()
    if target.is_dir() and (target / MANIFEST).is_file():
        return layout_read_bandwidth(target, max_bytes, engine)
    if target.is_file():
        return read_bandwidth(target, max_bytes, engine)
    scratch = target / SCRATCH_NAME
    try:
        write_scratch(scratch, scratch_bytes)
        return read_bandwidth(scratch, scratch_bytes, engine)
    finally:
        scratch.unlink(missing_ok=True)


def read_bytes(target: Path, max_bytes: int, scratch_bytes: int) -> int:
    """About how many bytes measure_disk reads of target (a layout's files, a file, or a scratch file)."""
    if target.is_dir() and (target / MANIFEST).is_file():
        return min(LAYOUT_PASSES * sum(f.stat().st_size for f in target.rglob("*") if f.is_file()), max_bytes)
    return min(target.stat().st_size, max_bytes) if target.is_file() else scratch_bytes


def layout_read_bandwidth(folder: Path, max_bytes: int, engine: IoEngine) -> dict:
    """The passes over as many of the layers, spread over the layout, as max_bytes holds in all (one
    at least): a 352 GB layout is not read three times over to time its disk."""
    layout = Layout.open(folder)
    layers = list(layout.manifest.layer_names)
    widest = max(layout.manifest.block(name).length for name in layers)
    chosen = spread(layers, max(max_bytes // (LAYOUT_PASSES * widest), 1))
    figures = read_pass(layout, chosen, passes=LAYOUT_PASSES, engine=engine)
    return {"file": str(folder), "bytes": figures["bytes_per_pass"] * LAYOUT_PASSES,
            "seconds": round(sum(figures["pass_s"]), 4), "read_gbps": figures["read_gbps"],
            "backend": figures["backend"]}


def read_bandwidth(file: Path, max_bytes: int, engine: IoEngine) -> dict:
    size = file.stat().st_size // ALIGNMENT * ALIGNMENT
    total = min(size, max_bytes) // REQUEST_BYTES * REQUEST_BYTES or min(size, max_bytes)
    if total == 0:
        raise ZeroliteError(f"{file} is empty: measure a bigger file or a folder (a scratch file is written there)")
    request = min(REQUEST_BYTES, total)
    buffers = [aligned_empty(request) for _ in range(REQUESTS_IN_FLIGHT)]
    for buffer in buffers:
        buffer.fill_(0)  # fault the pages in now, not inside the timed reads
    in_flight: list[int] = []
    started = time.perf_counter()
    finished = started
    for k, offset in enumerate(range(0, total, request)):
        if len(in_flight) == REQUESTS_IN_FLIGHT:
            finished = engine.wait(in_flight.pop(0))
        in_flight.append(engine.submit(file, buffers[k % REQUESTS_IN_FLIGHT][: min(request, total - offset)], offset))
    for ticket in in_flight:
        finished = engine.wait(ticket)
    seconds = finished - started
    return {"file": str(file), "bytes": total, "seconds": round(seconds, 4),
            "read_gbps": round(total / seconds / 1e9, 3), "backend": engine.backend}


def write_scratch(file: Path, nbytes: int) -> None:
    chunk = os.urandom(1 << 20) * 64  # incompressible, so no layer below can shortcut it
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        raise ZeroliteError(f"cannot write a scratch file in {file.parent}: {e.strerror}; "
                            "measure a folder you can write to") from e
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk[: nbytes - written])
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        file.unlink(missing_ok=True)
        raise ZeroliteError(f"writing the scratch file {file} failed: {e.strerror}; "
                            f"free {nbytes / 1e9:.1f} GB there") from e
    finally:
        os.close(fd)


def drop_page_cache() -> bool:
    """Where allowed (root), so that files read without O_DIRECT come from the disk too; says whether it was."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure_host_to_device(device: Device, nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """Pinned host-to-device copy bandwidth in GB/s, best of repeats; None where host memory is the
    device's. Timed by events on a stream of the measured device itself."""
    if not device.separate_memory:
        return None
    host = device.pinned_empty(nbytes)
    target = device.empty(nbytes)
    stream = device.new_stream()
    device.wait_stream(stream, device.compute_stream())  # target comes from the compute stream's memory
    best = 0.0
    for _ in range(repeats):
        begin = device.record(stream, timing=True)
        device.copy(target, host, stream)
        end = device.record(stream, timing=True)
        end.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
        if seconds > 0:
            best = max(best, nbytes / seconds / 1e9)
    return round(best, 3) if best else None
