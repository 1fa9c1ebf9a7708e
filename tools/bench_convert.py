"""zerolite convert beside a plain copy of the same bytes, both from a cold page cache: throughput,
and the converter's peak resident memory (which must not grow with the model). Run as root.

    python tools/bench_convert.py --source build/llama19/source [--weights int4] [--scratch DIR] [--json out.json]

The copy reads the checkpoint's weight files and writes them into --scratch (made durable with
fsync, as convert makes its layout); convert then writes a fresh layout there. Both outputs are
deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zerolite.convert.checkpoint import Checkpoint
from zerolite.planner.machine import drop_page_cache

COPY_CHUNK = 64 << 20


def plain_copy(files: list[Path], into: Path) -> float:
    """Seconds to copy files into a folder, chunk by chunk, each made durable."""
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as source, open(into / path.name, "wb", buffering=0) as target:
            while chunk := source.read(COPY_CHUNK):
                target.write(chunk)
            os.fsync(target.fileno())
    return time.perf_counter() - started


# The converter's own peak: its VmHWM, read by itself at exit. Not wait4's ru_maxrss: Linux
# carries the parent's resident memory at fork into the child's maximum (exec keeps the old
# image's high-water mark), so a bench that had written a 26 GB model read 2.06 GB for a
# converter that peaked at 1.12 GB.
RUN_AND_REPORT_PEAK = """
import atexit, runpy, sys
report = sys.argv[1]
atexit.register(lambda: open(report, "w").write(
    str(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024)))
sys.argv = ["zerolite", *sys.argv[2:]]
runpy.run_module("zerolite", run_name="__main__")
"""


def timed_convert(source: str, into: Path, weights: str | None) -> tuple[float, int]:
    """Seconds and peak RSS (bytes) of `zerolite convert` in a process of its own."""
    report = into.with_name(into.name + ".peak")
    command = [sys.executable, "-c", RUN_AND_REPORT_PEAK, str(report), "convert", source, "--path", str(into)]
    if weights:
        command += ["--weights", weights]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0 or not report.is_file():
        sys.exit(f"bench_convert: zerolite convert failed (exit {done.returncode})")
    peak = int(report.read_text())
    report.unlink()
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True)
    parser.add_argument("--weights", default=None, help="int8 or int4 (default: the checkpoint's precision)")
    parser.add_argument("--scratch", default=None, help="where the copy and the layout go (default: beside --source)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    checkpoint = Checkpoint.open(args.source)
    nbytes = sum(path.stat().st_size for path in checkpoint.weight_files)
    with tempfile.TemporaryDirectory(dir=args.scratch or Path(args.source).resolve().parent,
                                     prefix="convert-") as scratch:
        copy, layout = Path(scratch) / "copy", Path(scratch) / "layout"
        copy.mkdir()
        drop_page_cache()
        copy_s = plain_copy(list(checkpoint.weight_files), copy)
        shutil.rmtree(copy)
        drop_page_cache()
        convert_s, peak_rss = timed_convert(args.source, layout, args.weights)
    result = {"bytes": nbytes, "copy_s": copy_s, "convert_s": convert_s, "copy_gbps": nbytes / copy_s / 1e9,
              "convert_gbps": nbytes / convert_s / 1e9, "ratio": copy_s / convert_s, "convert_peak_rss_bytes": peak_rss,
              "weights": args.weights}
    print(f"{nbytes / 1e9:.2f} GB: plain copy {copy_s:.1f} s ({result['copy_gbps']:.2f} GB/s), convert"
          f"{' --weights ' + args.weights if args.weights else ''} "
          f"{convert_s:.1f} s ({result['convert_gbps']:.2f} GB/s) "
          f"= {result['ratio']:.2f}x the copy's throughput; convert's peak RSS {peak_rss / 1e9:.2f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
