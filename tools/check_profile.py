"""Do `zerolite profile`'s figures agree with independent measurements? Run as root (drops caches).

    python tools/check_profile.py --file build/bench-io-6g.bin --layout build/smollm2 [--repeat 3]

1. disk: `zerolite profile --disk FILE --json` beside fio (--direct=1, io_uring, 1 MiB chunks,
   depth 32, the engine's defaults) on the same file, taking turns, caches dropped before each run;
2. step: `zerolite profile --json` beside `zerolite generate --stats-json` with the same model,
   offload, depth, batch, prompt length and new tokens, taking turns, caches dropped before each:
   profile's mean decode step against generate's, batch / decode_tokens_per_s.
Prints medians and best runs, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_io import fio_gbps, make_file
from zerolite.planner.machine import DISK_READ_BYTES, REQUEST_BYTES, drop_page_cache

ZEROLITE = shutil.which("zerolite", path=os.path.dirname(sys.executable)) or "zerolite"


def zerolite_json(*args: str) -> dict:
    out = subprocess.run([ZEROLITE, *args, "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def generate_step_s(layout: str, settings: list[str], batch: int, prompt_tokens: int, new_tokens: int,
                    vocab: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        prompts, stats = Path(folder) / "prompts.jsonl", Path(folder) / "stats.json"
        rng = random.Random(0)
        prompts.write_text("".join(
            json.dumps({"id": i, "input_ids": [rng.randrange(vocab) for _ in range(prompt_tokens)]}) + "\n"
            for i in range(batch)
        ))
        subprocess.run([ZEROLITE, "generate", "--model", layout, *settings, "--input", str(prompts), "--batch-size",
                        str(batch), "--max-new-tokens", str(new_tokens), "--output", str(Path(folder) / "out.jsonl"),
                        "--stats-json", str(stats)], check=True, capture_output=True)
        result = json.loads(stats.read_text())
        # Rows may all end early on an end token: count the decode steps that really ran.
        return batch / result["decode_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", default="build/bench-io-6g.bin", help="file for the disk check (created if absent)")
    parser.add_argument("--size-gib", type=float, default=6.0)
    parser.add_argument("--layout", required=True, help="a converted layout for the step check")
    parser.add_argument("--offload", default="nvme")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefetch-depth", default="4")
    parser.add_argument("--cpu-memory", default="0", help="layers kept in host memory (0: every layer streams)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=15, help="pairs: this virtual disk swings 1-4 GB/s run to run")
    args = parser.parse_args()
    console = Console()
    if not shutil.which("fio"):
        sys.exit("fio is not installed: apt-get install -y fio")

    nbytes = int(args.size_gib * 2**30) // REQUEST_BYTES * REQUEST_BYTES
    make_file(args.file, nbytes)
    read_bytes = min(nbytes, DISK_READ_BYTES)  # fio reads what profile --disk reads
    runs: dict[str, list[float]] = {"fio": [], "profile --disk": [], "generate": [], "profile": []}
    settings = ["--offload", args.offload, "--device", args.device, "--prefetch-depth", args.prefetch_depth,
                "--cpu-memory", args.cpu_memory]
    config = json.loads((Path(args.layout) / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    disk_checks = {"fio": lambda: fio_gbps(args.file, read_bytes, 1 << 20, 32),
                   "profile --disk": lambda: zerolite_json("profile", "--disk", args.file)["read_gbps"]}
    for turn in range(args.repeat):
        for name in sorted(disk_checks, reverse=turn % 2 == 1):  # taking turns at going first
            drop_page_cache()
            runs[name].append(disk_checks[name]())
        drop_page_cache()
        runs["generate"].append(generate_step_s(args.layout, settings, args.batch_size, args.prompt_tokens,
                                                args.new_tokens, vocab))
        drop_page_cache()
        report = zerolite_json("profile", "--model", args.layout, *settings, "--batch-size", str(args.batch_size),
                               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens))
        runs["profile"].append(statistics.mean(report["step_s"]))

    # This machine's virtual disk flips between a fast and a slow mode from run to run; the best
    # runs compare like with like, the medians show how often each landed in which.
    table = Table(title=f"profile vs independent measurement, {args.repeat} runs each (all runs in brackets)")
    for column in ("figure", "reference", "zerolite profile", "median ratio", "best ratio"):
        table.add_column(column, justify="right")
    for label, reference, ours, best in (("disk read GB/s", "fio", "profile --disk", max),
                                         ("decode step s", "generate", "profile", min)):
        ref, own = statistics.median(runs[reference]), statistics.median(runs[ours])
        table.add_row(label, f"{ref:.3f} ({', '.join(f'{v:.3f}' for v in runs[reference])})",
                      f"{own:.3f} ({', '.join(f'{v:.3f}' for v in runs[ours])})", f"{own / ref:.0%}",
                      f"{best(runs[ours]) / best(runs[reference]):.0%}")
    console.print(table)


if __name__ == "__main__":
    main()
