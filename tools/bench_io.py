"""Sequential O_DIRECT read bandwidth of the engine, beside fio's on the same file and settings.

    python tools/bench_io.py [--file PATH] [--size-gib 2] [--depths 8,32] [--chunk-kib 256,1024]
    python tools/bench_io.py --first-read 5 [--file PATH] [--size-gib 1]

For each chunk size and queue depth: drop the page cache, run fio (--direct=1, io_uring, the same
chunk size as --bs, and depth), then drop it again before each engine backend reads the whole file as
zerolite profile --disk does (zerolite.planner.machine.read_bandwidth: 64 MiB requests, four in flight). Prints each
bandwidth as "median (best)" of --repeat runs, and its ratio to fio's. Run as root so the caches can be dropped.

--first-read N: the first read of a process into memory it never used, as loading a tier does. N rounds,
each: caches dropped, fio (1 MiB blocks, depth 32, the engine's defaults); then three fresh processes, each
after dropping the caches and waiting for the freed memory to be handed back to the host (a VM with free
page reporting does that within seconds): one touches a fresh buffer's pages alone, one reads the file into
a fresh buffer of 4 KiB pages (what a host tier or resident block is filled in), one into huge pages (what a
slot is; zerolite.io.engine.host_mapping says why the two differ). fio reads into a few small buffers of
its own and never pays for first touches. fio runs again after them, caches dropped, and the faster of its
two runs is the bound.
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
from zerolite.planner.machine import REQUEST_BYTES, drop_page_cache, read_bandwidth, write_scratch

REPORTING_WAIT_S = 3  # the kernel reports freed pages to the host two seconds after they are freed


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


def first_read_gbps(path: str, how: str) -> float:
    """In a fresh process, caches dropped and the memory they held handed back to the host: the whole
    file read by one submit() into a fresh buffer in 4 KiB pages, as a host tier or a resident block
    loads ("small"), or in huge pages, as a slot is first read into ("huge"); or no read, a fresh
    buffer's small pages touched alone ("touch")."""
    code = (
        "import os, sys, time; from zerolite.io.engine import IoEngine, aligned_empty\n"
        "from zerolite.planner.machine import drop_page_cache\n"
        "path, how = sys.argv[1], sys.argv[2]; engine = IoEngine(); size = os.path.getsize(path)\n"
        f"drop_page_cache(); time.sleep({REPORTING_WAIT_S})\n"
        "started = time.perf_counter(); buffer = aligned_empty(size, huge_pages=how == 'huge')\n"
        "if how == 'touch': buffer[::4096].zero_()  # a byte of every page: mapped now\n"
        "finished = time.perf_counter() if how == 'touch' else engine.wait(engine.submit(path, buffer))\n"
        "print(size / (finished - started) / 1e9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path, how], check=True, capture_output=True, text=True).stdout
    return float(out)


def first_reads(path: str, nbytes: int, rounds: int, console: Console) -> None:
    table = Table(title=f"first reads of {nbytes / 2**30:.1f} GiB into fresh memory: "
                        "a fresh process each, caches dropped")
    for column in ["round", "fio GB/s", "touch alone GB/s", "read GB/s", "read / fio", "huge pages: read GB/s",
                   "huge / fio"]:
        table.add_column(column, justify="right")
    ratios = []
    for round_ in range(1, rounds + 1):
        # fio before and after the engine's reads, the faster taken: the host's cache below the guest
        # can favour whichever reads the file later.
        drop_page_cache()
        fio_before = fio_gbps(path, nbytes, 1 << 20, 32)
        touch, small, huge = (first_read_gbps(path, how) for how in ("touch", "small", "huge"))
        drop_page_cache()
        fio = max(fio_before, fio_gbps(path, nbytes, 1 << 20, 32))
        ratios.append(small / fio)
        table.add_row(str(round_), f"{fio:.2f}", f"{touch:.2f}", f"{small:.2f}", f"{small / fio:.2f}", f"{huge:.2f}",
                      f"{huge / fio:.2f}")
    console.print(table)
    console.print(f"first reads at >= 0.9x fio: {sum(r >= 0.9 for r in ratios)} of {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first-read", type=int, metavar="ROUNDS",
                        help="measure first reads into fresh memory instead")
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
    if args.first_read:
        first_reads(args.file, nbytes, args.first_read, console)
        return

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
                *[f"{statistics.median(runs[b]) / reference:.0%} ({max(runs[b]) / best_reference:.0%})"
                  for b in backends],
            )
    console.print(table)


if __name__ == "__main__":
    main()
