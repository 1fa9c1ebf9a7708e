"""Streaming in place beside its converted layout, on one safetensors checkpoint: tokens, decode
speed, first token and what each writes. Run as root (the page cache is dropped before each run).

    python tools/bench_in_place.py --source build/llama19/source --layout build/llama19/layout \
        [--batch-size 16] [--new-tokens 8] [--rounds 3] [--scratch DIR] [--json out.json]

A mixture of experts: --make-mixture builds a missing --source (tools/bench_moe.py's 1.94 GB bf16
Mixtral-shaped model, saved as transformers saves it: one tensor per expert and matrix, as the hub's
Mixtral checkpoints are) and converts a missing --layout from it; both then stream per expert, only
the experts the router picks read (in place, each from its parts of the shards).

    python tools/bench_in_place.py --source build/mixtral2g/source --layout build/mixtral2g/layout --make-mixture

1. first token, each from nothing: convert into a fresh layout then generate (convert-first), and
   plan in place into a fresh folder then generate (in-place); ready + prefill, from process start,
   and the part that differs: converting, or planning in place (the rest, the interpreter, imports,
   loading and the prefill, both pay alike; starting Python and importing alone is timed apart, in a
   fresh process with caches dropped, median of 3);
2. decode, --rounds rounds of both taking turns, every layer streamed (--cpu-memory 0): the median
   step of each, its tokens/s (batch / step), and whether their tokens are the same;
3. what each wrote: the converted layout's bytes, the in-place folder's.
Each run is a fresh process (tools/bench_contenders.py), the page cache dropped before it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import QUANTIZED, folder_bytes, run_contender
from zerolite.planner.machine import drop_page_cache

IN_PLACE, LAYOUT, CONVERT_FIRST = "zerolite-nvme-in-place", "zerolite-nvme", "zerolite-nvme-convert-first"


def decode_step(result: dict) -> float:
    return statistics.median(result["step_s"])


def start_and_imports_s() -> float:
    """Seconds for a fresh process, caches dropped, to start Python and import what a run of either
    kind imports before anything of the model is read (torch, transformers' modelling): both pay it."""
    drop_page_cache()
    # Until the imports are done, as the runs' clocks stop at their first token: not the exit after.
    code = "import sys, time; import zerolite.lm; print(time.time() - float(sys.argv[1]))"
    return float(subprocess.run([sys.executable, "-c", code, str(time.time())], check=True, capture_output=True,
                                text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="a safetensors model folder")
    parser.add_argument("--layout", required=True, help="its converted layout (tools/bench.py --make-model makes both)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="where the fresh layouts go (default: beside --layout)")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--json", default=None)
    parser.add_argument("--make-mixture", action="store_true",
                        help="build a missing --source as tools/bench_moe.py's Mixtral-shaped model, and its --layout")
    args = parser.parse_args()
    if args.make_mixture:
        from bench_moe import MODEL_CONFIG
        from models import make_model

        make_model(Path(args.source), "mixtral", MODEL_CONFIG, {Path(args.layout): {}})
    args.device, args.gguf_folder, args.llamacpp_plain, args.llamacpp_in_ram = "cpu", "", False, False
    for scheme in QUANTIZED:
        setattr(args, f"{scheme}_layout", args.layout)
    console = Console(width=None if sys.stdout.isatty() else 160)

    results: dict[str, list[dict]] = {IN_PLACE: [], LAYOUT: []}
    with tempfile.TemporaryDirectory(dir=args.scratch or Path(args.layout).resolve().parent,
                                     prefix="in-place-") as scratch:
        def run(name: str) -> dict:
            result = run_contender(name, args, 0, scratch, None)
            if "error" in result:
                sys.exit(f"bench_in_place: {name} failed: {result['error']}")
            return result

        imports = statistics.median(start_and_imports_s() for _ in range(3))
        converted = run(CONVERT_FIRST)
        written_converted = folder_bytes(Path(scratch) / "converted")
        shutil.rmtree(Path(scratch) / "converted")
        first_in_place = run(IN_PLACE)  # plans into the fresh in-place folder
        written_in_place = folder_bytes(Path(scratch) / "in-place")
        for round_ in range(args.rounds):
            for name in (IN_PLACE, LAYOUT) if round_ % 2 == 0 else (LAYOUT, IN_PLACE):
                results[name].append(run(name))
                console.print(f"round {round_ + 1} {name}: decode step {decode_step(results[name][-1]):.3f} s",
                              highlight=False)

    first_token = {name: r["ready_s"] + r["prefill_s"]
                   for name, r in ((CONVERT_FIRST, converted), (IN_PLACE, first_in_place))}
    prepare = {CONVERT_FIRST: converted["prepare_s"], IN_PLACE: first_in_place["prepare_s"]}
    steps = {name: statistics.median(map(decode_step, runs)) for name, runs in results.items()}
    same = all(r["tokens"] == results[LAYOUT][0]["tokens"] for runs in results.values() for r in runs)
    summary = {
        "batch_size": args.batch_size, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "first_token_s": first_token, "first_token_ratio": first_token[IN_PLACE] / first_token[CONVERT_FIRST],
        "start_and_imports_s": imports,
        "first_token_beyond_imports_ratio": (first_token[IN_PLACE] - imports) / (first_token[CONVERT_FIRST] - imports),
        "prepare_s": prepare, "prepare_ratio": prepare[IN_PLACE] / prepare[CONVERT_FIRST],
        "decode_step_s": steps,
        "steps_by_round": {name: [round(decode_step(r), 4) for r in runs] for name, runs in results.items()},
        "tokens_per_s": {name: args.batch_size / step for name, step in steps.items()},
        "tokens_per_s_ratio": steps[LAYOUT] / steps[IN_PLACE], "same_tokens": same,
        "written_bytes": {"converted layout": written_converted, "in place": written_in_place},
    }
    table = Table(title=f"in place vs converted: batch {args.batch_size}, {args.new_tokens} new tokens, "
                        "every layer streamed, page cache dropped before each run")
    for column in ("", "in place", "converted layout", "in place / converted"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row("first token from nothing (s)", f"{first_token[IN_PLACE]:.1f}",
                  f"{first_token[CONVERT_FIRST]:.1f} (convert first)", f"{summary['first_token_ratio']:.2f}x")
    table.add_row("  of which starting Python, importing torch and transformers (s)", f"{imports:.1f}",
                  f"{imports:.1f}", "")
    table.add_row("  beyond that (s)", f"{first_token[IN_PLACE] - imports:.1f}",
                  f"{first_token[CONVERT_FIRST] - imports:.1f}", f"{summary['first_token_beyond_imports_ratio']:.2f}x")
    table.add_row("  of which converting / planning in place (s)", f"{prepare[IN_PLACE]:.2f}",
                  f"{prepare[CONVERT_FIRST]:.2f}", f"{summary['prepare_ratio']:.2f}x")
    table.add_row(f"decode step, median of {args.rounds} (s)", f"{steps[IN_PLACE]:.3f}", f"{steps[LAYOUT]:.3f}",
                  f"{steps[IN_PLACE] / steps[LAYOUT]:.2f}x")
    table.add_row("tokens/s", f"{summary['tokens_per_s'][IN_PLACE]:.2f}", f"{summary['tokens_per_s'][LAYOUT]:.2f}",
                  f"{summary['tokens_per_s_ratio']:.2f}x")
    table.add_row("written (MB)", f"{written_in_place / 1e6:.3f}", f"{written_converted / 1e6:.1f}", "")
    console.print(table)
    console.print(f"same tokens in every run: {same}", highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
