"""How many sequences of a long context fit in a fixed memory budget with the K/V cache at 16, 8 and
4 bits (--kv-bits), and how fast a decode step runs at that batch against its bound. Run as root
(a memory cgroup).

    python tools/bench_kv_bits.py [--memory-limit 2.4GB] [--context 2048] [--new-tokens 8]
                                  [--bits 16,8,4] [--rounds 2] [--threads 1] [--folder /tmp/kv-bits] [--json out.json]

The model is one whose K/V dominates its memory: a Llama-shaped bf16 model with random weights,
96 layers of hidden 128 and one 128-wide head (MHA), MLP 256, vocabulary 512 (31 MB of weights; a
token adds 48 KB of K/V at 16 bits), written under --folder and converted to a layout once.

Each sequence holds --context tokens of K/V (2048: 4-bit keys wait for their group of 128 tokens at
8 bits, which costs a short context more than a long one) put straight into the cache, as random
states (what the prefill would leave, byte for byte, without its hour of attention on two cores),
then generates exactly --new-tokens. For each bits:

1. in a fresh process inside a memory cgroup of --memory-limit (tools/bench_cgroup: v2 where
   available, else v1, swap limited too): zerolite.load(offload="nvme", cpu_memory=0, kv_bits=...)
   streams every layer from the layout, --batch-size auto's batch is taken (largest_batch: the room
   the cgroup leaves, the K/V at its bits with its scales, the keys waiting for their group and what
   reading it decodes), the cache filled and the tokens generated. Reported: the batch, whether it
   ran (no OOM kill), the cgroup's peak memory, the median decode step and tokens/s (batch x steps /
   their seconds; the first token, which reads the context, left out).
2. in one fresh process outside the cgroup, at that batch: the step and its bound measured side by
   side, --rounds times over: the streamed job (as in 1), then the same cache (cropped back to the
   context) decoded with every layer in RAM (offload="none": the in-RAM compute, dequantising the
   K/V included), then zerolite's engine reading every layer in decode order with no compute
   (zerolite.layout.read_pass, --new-tokens passes). The bound is max(read pass, in-RAM step), the
   medians over the rounds; "step / bound" is the streamed step's median over it, all three taken in
   the same process minutes apart at most, so that the shared machine's load moves them alike.

Each run uses --threads torch threads (1 by default) and a fixed glibc mmap threshold (64 KiB):
with glibc's own, which grows to 32 MB as large blocks are freed, the K/V that grows a token each
step comes from the heap, whose holes outgrow the cgroup (8-bit K/V was OOM-killed at the batch
that fits without them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

import zerolite
from bench_cgroup import MemoryCgroup, parse_limit
from zerolite.convert.writer import convert
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import MANIFEST
from zerolite.layout.read_pass import read_pass
from zerolite.memory_model import ModelShape, kv_bytes_per_token
from zerolite.planner.machine import drop_page_cache
from zerolite.runtime.batching import decide_batch_size, largest_batch

MODEL_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=96, num_attention_heads=1,
                    num_key_value_heads=1, head_dim=128, vocab_size=512, max_position_embeddings=4096,
                    tie_word_embeddings=False)


def make_layout(folder: Path) -> Path:
    """The model's layout under folder, written and converted once."""
    layout = folder / "layout"
    if (layout / MANIFEST).is_file():
        return layout
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **MODEL_CONFIG, dtype="bfloat16")
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder / "source")
    convert(folder / "source", layout, show_progress=False)
    return layout


class Steps(BaseStreamer):
    """When each step's tokens came out (generate's first put is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


FILL_TOKENS = 128  # the context is put into the cache this many tokens at a time (a 4-bit key group)


def filled_cache(lm, batch: int, context: int):
    """A cache of lm's holding context tokens of random K/V for batch sequences."""
    cache, shape = lm.new_cache(), ModelShape.of(lm.config)
    generator = torch.Generator().manual_seed(0)
    for layer in range(len(shape.growing)):
        for start in range(0, context, FILL_TOKENS):
            states = [torch.randn(batch, shape.kv_heads, min(FILL_TOKENS, context - start), shape.head_dim,
                                  generator=generator).to(lm.model.dtype) for _ in range(2)]
            cache.update(*states, layer)
    return cache


def decode(lm, cache, batch: int, context: int, new_tokens: int) -> list[float]:
    """Generates new_tokens for batch sequences after the context cache holds: the decode steps' seconds."""
    ids = torch.randint(3, MODEL_CONFIG["vocab_size"], (batch, context + 1), generator=torch.Generator().manual_seed(1))
    steps = Steps()
    lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=steps)
    return [b - a for a, b in zip(steps.times[1:], steps.times[2:])]  # after the first token, which reads the context


def child(args) -> None:
    """One run, in this process: prints its figures as one JSON line."""
    streamed = dict(offload="nvme", cpu_memory=0, kv_bits=args.kv_bits, show_progress=False, device="cpu")
    with torch.no_grad(), zerolite.load(args.layout, **streamed) as lm:
        batch = decide_batch_size(args.batch or None, fits=lambda: largest_batch(
            lm, [1] * 4096, args.context + args.new_tokens - 1))  # one token fed a step, every position in the cache
        started = time.perf_counter()
        cache = filled_cache(lm, batch, args.context)
        fill_s = time.perf_counter() - started
        if args.where == "cgroup":
            steps = decode(lm, cache, batch, args.context, args.new_tokens)
            print(json.dumps({"batch": batch, "fill_s": fill_s, "step_s": statistics.median(steps),
                              "tokens_per_s": batch * len(steps) / sum(steps)}))
            return
        layout = Layout.open(args.layout)
        rounds = {"step_s": [], "compute_s": [], "read_s": []}
        with zerolite.load(args.layout, **{**streamed, "offload": "none"}) as in_ram:
            for _ in range(args.rounds):
                rounds["step_s"].append(statistics.median(decode(lm, cache, batch, args.context, args.new_tokens)))
                cache.crop(-args.new_tokens)
                rounds["compute_s"].append(statistics.median(decode(in_ram, cache, batch, args.context,
                                                                    args.new_tokens)))
                cache.crop(-args.new_tokens)
                rounds["read_s"].append(read_pass(layout, list(layout.manifest.layer_names),
                                                  passes=args.new_tokens)["median_pass_s"])
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    bound = max(medians["read_s"], medians["compute_s"])
    print(json.dumps({"batch": batch, **medians, "bound_s": bound, "step_over_bound": medians["step_s"] / bound,
                      "rounds": rounds}))


def run_child(args, layout: Path, bits: int, where: str, batch: int, cgroup: MemoryCgroup | None) -> dict:
    command = [sys.executable, __file__, "--child", "--layout", str(layout), "--kv-bits", str(bits), "--where", where,
               "--batch", str(batch), "--context", str(args.context), "--new-tokens", str(args.new_tokens),
               "--rounds", str(args.rounds)]
    return child_result(command, args, cgroup)


def child_result(command: list[str], args, cgroup: MemoryCgroup | None) -> dict:
    """Runs a child's command (in cgroup, where given) and returns the JSON its last line printed,
    or {"error": what stopped it}."""
    if cgroup is not None:
        command = cgroup.wrap(command)
    # A fixed mmap threshold: glibc's own grows to 32 MB as large blocks are freed, after which the
    # K/V that grows a token each step is carved from the heap, whose holes outgrow the cgroup.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        killed = cgroup.oom_kills() if cgroup is not None else 0
        return {"error": "OOM-killed" if killed or done.returncode == -9 else
                (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-limit", type=parse_limit, default=parse_limit("2.4GB"))
    parser.add_argument("--context", type=int, default=2048, help="tokens of K/V each sequence holds before decoding")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--bits", default="16,8,4")
    parser.add_argument("--rounds", type=int, default=2,
                        help="streamed, in-RAM and read-pass measurements, in turn (0: the fit in the cgroup alone)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/kv-bits"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads in each run (1: steady on a machine others share; OpenMP's spinning "
                        "threads slow every op 50x when the cores are oversubscribed)")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kv-bits", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    layout = make_layout(args.folder)
    config = AutoConfig.from_pretrained(Layout.open(layout).side_folder)
    rows = []
    for bits in [int(each) for each in args.bits.split(",")]:
        cgroup = MemoryCgroup.create(f"kv-bits-{bits}", args.memory_limit)
        try:
            fit = run_child(args, layout, bits, "cgroup", 0, cgroup)
            peak = cgroup.peak_bytes()
        finally:
            cgroup.remove()
        row = {"kv_bits": bits, "kv_bytes_per_token": kv_bytes_per_token(config, torch.bfloat16, bits),
               "peak_bytes": peak, **fit}
        if "error" not in fit and args.rounds:
            drop_page_cache()
            row["outside"] = run_child(args, layout, bits, "outside", fit["batch"], None)
        rows.append(row)
        console.print(f"{bits} bits: {json.dumps(row)}", highlight=False)

    base = next((row for row in rows if row["kv_bits"] == 16 and "batch" in row), None)
    table = Table(title=f"K/V bits in a {args.memory_limit / 1e9:.2f} GB cgroup: {MODEL_CONFIG['num_hidden_layers']} "
                        f"layers, {args.context} tokens of context + {args.new_tokens} new a sequence, every layer "
                        "streamed")
    for column in ("K/V bits", "K/V bytes a token", "batch (auto)", "vs 16 bits", "peak GB", "step s", "tokens/s",
                   "step s outside", "in-RAM step s", "read pass s", "step / bound"):
        table.add_column(column, justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(str(row["kv_bits"]), f"{row['kv_bytes_per_token']:,}", row["error"], *["-"] * 8)
            continue
        outside = row.get("outside", {"error": "not run"})
        measured = "error" not in outside
        table.add_row(str(row["kv_bits"]), f"{row['kv_bytes_per_token']:,}", str(row["batch"]),
                      f"{row['batch'] / base['batch']:.2f}x" if base else "-", f"{row['peak_bytes'] / 1e9:.2f}",
                      f"{row['step_s']:.3f}", f"{row['tokens_per_s']:.0f}",
                      *([f"{outside['step_s']:.3f}", f"{outside['compute_s']:.3f}", f"{outside['read_s']:.3f}",
                         f"{outside['step_over_bound']:.2f}x"] if measured else [outside["error"], "-", "-", "-"]))
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"memory_limit": args.memory_limit, "model": MODEL_CONFIG,
                                         "context": args.context, "new_tokens": args.new_tokens,
                                         "runs": rows, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
