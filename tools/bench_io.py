"""Sequential O_DIRECT read bandwidth of the engine, beside fio's on the same file and settings.

    python tools/bench_io.py [--file PATH] [--size-gib 2] [--depths 8,32] [--chunk-kib 256,1024]

For each chunk size and queue depth: drop the page cache, run fio (--direct=1, io_uring, the same
chunk size as --bs, and depth), then drop it again before each engine backend reads the whole file as
zerolite profile --disk does (zerolite.profile.machine.read_bandwidth: 64 MiB requests, four in flight). Prints each
bandwidth as "median (best)" of --repeat runs, and its ratio to fio's. Run as root so the caches can be dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zerolite.io.engine import IoEngine
from zerolite.profile.machine import REQUEST_BYTES, drop_page_cache, read_bandwidth, write_scratch


def make_file(path: str, nbytes: int) -> None:
    if not (os.path.exists(path) and os.path.getsize(path) == nbytes):
        write_scratch(Path(path), nbytes)


def fio_gbps(path: str, nbytes: int, chunk_bytes: int, depth: int) -> float:
    out = subprocess.run(
        ["fio", "--name=seq", f"--filename={path}", "--readonly", "--rw=read", "--direct=1", "--ioengine=io_uring",
         f"--bs={chunk_bytes}", f"--iodepth={depth}", f"--size={nbytes}", "--output-format=json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"] / 1e9


def engine_gbps(path: str, nbytes: int, backend: str, chunk_bytes: int, depth: int) -> float:
    engine = IoEngine(backend, queue_depth=depth, chunk_bytes=chunk_bytes)
    return read_bandwidth(Path(path), nbytes, engine)["read_gbps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", default="build/bench-io.bin", help="file to read (created if absent)")
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--depths", default="4,16,32")
    parser.add_argument("--chunk-kib", default="256,1024")
    parser.add_argument("--backends", default="io_uring,pread")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contender; the median is shown")
    args = parser.parse_args()

    console = Console()
    if not shutil.which("fio"):
        sys.exit("fio is not installed: apt-get install -y fio")
    nbytes = int(args.size_gib * 2**30) // REQUEST_BYTES * REQUEST_BYTES
    os.makedirs(os.path.dirname(os.path.abspath(args.file)), exist_ok=True)
    make_file(args.file, nbytes)
    if not drop_page_cache():
        console.print("[yellow]cannot drop the page cache (not root): engine reads still bypass it (O_DIRECT)")

    backends = args.backends.split(",")
    table = Table(title=f"sequential O_DIRECT reads of {nbytes / 2**30:.1f} GiB, {args.file}")
    for column in ["chunk", "depth", "fio GB/s"] + [f"{b} GB/s" for b in backends] + [f"{b} / fio" for b in backends]:
        table.add_column(column, justify="right")
    for chunk_kib in map(int, args.chunk_kib.split(",")):
        for depth in map(int, args.depths.split(",")):
            # Contenders take turns within each repeat, so a drift of the disk hits them alike.
            runs: dict[str, list[float]] = {name: [] for name in ["fio", *backends]}
            for _ in range(args.repeat):
                drop_page_cache()
                runs["fio"].append(fio_gbps(args.file, nbytes, chunk_kib << 10, depth))
                for backend in backends:
                    drop_page_cache()
                    runs[backend].append(engine_gbps(args.file, nbytes, backend, chunk_kib << 10, depth))
            # The virtual disk here swings by 2x between runs; the best run shows what each can reach.
            reference = statistics.median(runs["fio"])
            best_reference = max(runs["fio"])
            table.add_row(
                f"{chunk_kib} KiB", str(depth), f"{reference:.2f} ({best_reference:.2f})",
                *[f"{statistics.median(runs[b]):.2f} ({max(runs[b]):.2f})" for b in backends],
                *[f"{statistics.median(runs[b]) / reference:.0%} ({max(runs[b]) / best_reference:.0%})" for b in backends],
            )
    console.print(table)


if __name__ == "__main__":
    main()
