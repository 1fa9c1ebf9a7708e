"""What this machine was measured to do, kept for the planner: the disk's read rate (per file
system), host-to-device copies, how fast the host tier fills from disk, and the compute probe.

    record("h2d_gbps", 24.7)                 # zerolite profile, after measuring
    recorded()["disk_gbps"]["2049"]          # a file system's, by st_dev

One JSON file in zerolite's cache (zerolite.convert.paths.cache_dir), rewritten whole and atomically
at every record: several runs may record at once, and the last writer wins, which is what a
measurement wants. Compute is recorded per CPU (or GPU), dtype and torch version, as kernels differ.

A probe timed while other work took the cores (zerolite.planner.contention) is recorded marked
busy: plans use it while the machine stays busy (probing again then would time the same load, and
take seconds each plan), and the first plan that finds the machine quiet, RETRY_S after it, takes
it again (kept() says so by returning None). Unmarked, a probe timed at a load of 10 once
priced a model's decode step at 6x its time for every plan after.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from zerolite.convert.paths import cache_dir
from zerolite.io.device import Device
from zerolite.planner.contention import quiet_now

FILE = "machine.json"
DISK_RECORDED_BYTES = 256 << 20   # a disk read over fewer bytes says more about latency than rate: not kept
RETRY_S = 300                     # a probe marked busy is taken again this long after, by a plan that finds the
                                  # machine quiet


def path() -> Path:
    return cache_dir() / FILE


def recorded() -> dict:
    try:
        return json.loads(path().read_text())
    except (OSError, ValueError):
        return {}


def record(key: str, value, under: str | None = None, busy_cores: float | None = None) -> None:
    """Sets key (within the map under, where given) to value, with the time it was measured;
    busy_cores: the cores other work took meanwhile, for a probe timed on a busy machine."""
    from zerolite.convert.writer import write_atomically

    data = recorded()
    entry = {"value": value, "measured": time.strftime("%Y-%m-%d %H:%M")}
    if busy_cores is not None:
        entry["busy"] = {"others_cores": round(busy_cores, 2), "at": int(time.time())}
    if under is None:
        data[key] = entry
    else:
        data.setdefault(under, {})[key] = entry
    try:
        path().parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path(), json.dumps(data, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache costs the next plan a measurement, nothing else


def record_disk(folder, gbps: float, nbytes: int) -> None:
    """The read rate of folder's file system, if measured over enough bytes to stand for it."""
    if nbytes >= DISK_RECORDED_BYTES:
        record(file_system(folder), gbps, "disk_gbps")


def record_fill(nbytes: int, seconds: float) -> None:
    """A load that filled memory: kept as running totals, so that the rate is bytes over seconds of
    every load recorded, and a large cold load outweighs small ones (a small load may find its
    pages warm in caches below the guest, and fill several times faster than a large one)."""
    totals = value("fill") or {"bytes": 0, "seconds": 0.0}
    record("fill", {"bytes": totals["bytes"] + nbytes, "seconds": totals["seconds"] + seconds})


def fill_gbps() -> float | None:
    totals = value("fill")
    return totals["bytes"] / totals["seconds"] / 1e9 if totals and totals["seconds"] > 0 else None


def value(key: str, under: str | None = None):
    entry = recorded_entry(key, under)
    return entry["value"] if entry else None


def recorded_entry(key: str, under: str | None = None) -> dict | None:
    data = recorded()
    return (data.get(under, {}) if under else data).get(key)


def kept(key: str, under: str | None = None):
    """A probe's value as recorded, or None where it is to be taken again: none recorded, or one
    marked busy RETRY_S ago or more while the machine is quiet now."""
    entry = recorded_entry(key, under)
    if entry is None:
        return None
    busy = entry.get("busy")
    if busy and time.time() - busy["at"] >= RETRY_S and quiet_now():
        return None
    return entry["value"]


def file_system(folder: str | os.PathLike) -> str:
    """The key a disk's rate is kept under: the device number of the file system holding folder."""
    return str(nearest_existing(folder).stat().st_dev)


def nearest_existing(path: str | os.PathLike) -> Path:
    """path, or where a path not made yet will be made: the nearest folder above it that exists
    (on the same disk as a rule)."""
    target = Path(path).expanduser()
    while not target.exists():
        target = target.parent
    return target


def compute_key(device: Device, dtype: torch.dtype) -> str:
    """Compute rates are kept per processor, threads, dtype and torch version."""
    return (f"{device.processor()} | {torch.get_num_threads()} threads | {str(dtype).removeprefix('torch.')} | "
            f"torch {torch.__version__}")
