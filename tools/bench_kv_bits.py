"""How many sequences fit in a fixed memory budget with the K/V cache at 16, 8 and 4 bits (--kv-bits),
and how fast a decode step runs at that batch against its bound. Run as root (a memory cgroup).

    python tools/bench_kv_bits.py [--memory-limit 1.0GB] [--prompt-tokens 8] [--new-tokens 40]
                                  [--bits 16,8,4] [--threads 1] [--folder /tmp/kv-bits] [--json out.json]

The model is one whose K/V dominates its memory: a Llama-shaped bf16 model with random weights,
96 layers of hidden 128 and one 128-wide head (MHA), MLP 256, vocabulary 512 (31 MB of weights; a
token adds 48 KB of K/V at 16 bits), written under --folder and converted to a layout once.

For each bits, in a fresh process inside a memory cgroup of --memory-limit (tools/bench_cgroup: v2
where available, else v1, swap limited too): zerolite.load(offload="nvme", cpu_memory=0, kv_bits=...)
streams every layer from the layout, --batch-size auto's batch is taken (decide_batch_size with
largest_batch: the room the cgroup leaves, the K/V at its bits with its scales and what reading it
decodes), and that many random prompts of --prompt-tokens generate exactly --new-tokens each. Reported:
the batch, whether it ran (no OOM kill), the cgroup's peak memory, the median decode step and tokens/s
(batch x new tokens / the decode's seconds, the prefill left out).

The bound of each step: max(read pass, in-RAM compute at that batch). The read pass: zerolite's
engine reading every layer in decode order with no compute (zerolite.layout.read_pass), median of
--new-tokens passes. The in-RAM compute: the same job with every layer resident (offload="none") at
the same batch and bits, in a fresh process outside the cgroup: its median decode step (which
includes dequantising the K/V at 8 and 4 bits, work a streamed step does too). The streamed run is
repeated outside the cgroup at the same batch ("step s outside"): what the step costs when the
process is not held at the edge of its memory limit.

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
from zerolite.memory_model import kv_bytes_per_token
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


def child(args) -> None:
    """One run, in this process: prints its figures as one JSON line."""

    class Steps(BaseStreamer):
        """When each step's tokens came out (generate's first put is the prompt)."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    offload = dict(offload="nvme", cpu_memory=0) if args.where == "streamed" else dict(offload="none")
    with zerolite.load(args.layout, device="cpu", kv_bits=args.kv_bits, show_progress=False, **offload) as lm:
        batch = decide_batch_size(args.batch or None,
                                  fits=lambda: largest_batch(lm, [args.prompt_tokens] * 4096, args.new_tokens))
        prompts = torch.randint(3, MODEL_CONFIG["vocab_size"], (batch, args.prompt_tokens),
                                generator=torch.Generator().manual_seed(0))
        steps = Steps()
        lm.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, streamer=steps)
    decode = [b - a for a, b in zip(steps.times[1:], steps.times[2:])]  # after the prefill's first token
    print(json.dumps({"batch": batch, "step_s": statistics.median(decode), "decode_s": sum(decode),
                      "tokens_per_s": batch * len(decode) / sum(decode)}))


def run_child(args, layout: Path, bits: int, where: str, batch: int, cgroup: MemoryCgroup | None) -> dict:
    command = [sys.executable, __file__, "--child", "--layout", str(layout), "--kv-bits", str(bits), "--where", where,
               "--batch", str(batch), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
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
    parser.add_argument("--memory-limit", type=parse_limit, default=parse_limit("1.0GB"))
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--bits", default="16,8,4")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/kv-bits"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads in each run (1: steady on a machine others share; OpenMP's spinning "
                        "threads slow every op 50x when the cores are oversubscribed)")
    parser.add_argument("--timeout", type=int, default=1800)
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
    opened = Layout.open(layout)
    drop_page_cache()
    read_s = read_pass(opened, list(opened.manifest.layer_names), passes=args.new_tokens)["median_pass_s"]
    console.print(f"read pass over the {opened.manifest.nbytes(opened.manifest.layer_names) / 1e6:.0f} MB of layers: "
                  f"{read_s * 1e3:.1f} ms", highlight=False)
    config = AutoConfig.from_pretrained(opened.side_folder)
    rows = []
    for bits in [int(each) for each in args.bits.split(",")]:
        cgroup = MemoryCgroup.create(f"kv-bits-{bits}", args.memory_limit)
        try:
            fit = run_child(args, layout, bits, "streamed", 0, cgroup)
            peak = cgroup.peak_bytes()
        finally:
            cgroup.remove()
        row = {"kv_bits": bits, "kv_bytes_per_token": kv_bytes_per_token(config, torch.bfloat16, bits),
               "peak_bytes": peak, **fit}
        if "error" not in fit:
            row["outside"] = run_child(args, layout, bits, "streamed", fit["batch"], None)
            row["compute"] = run_child(args, layout, bits, "in-ram", fit["batch"], None)
            if "error" not in row["compute"]:
                row["bound_s"] = max(read_s, row["compute"]["step_s"])
        rows.append(row)
        console.print(f"{bits} bits: {json.dumps(row)}", highlight=False)

    base = next((row for row in rows if row["kv_bits"] == 16 and "batch" in row), None)
    table = Table(title=f"K/V bits in a {args.memory_limit / 1e9:.2f} GB cgroup: {MODEL_CONFIG['num_hidden_layers']} "
                        f"layers, {args.prompt_tokens} + {args.new_tokens} tokens a sequence, every layer streamed")
    for column in ("K/V bits", "K/V bytes a token", "batch (auto)", "vs 16 bits", "peak GB", "step s", "tokens/s",
                   "step s outside", "in-RAM step s", "bound s", "step / bound", "outside / bound"):
        table.add_column(column, justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(str(row["kv_bits"]), f"{row['kv_bytes_per_token']:,}", row["error"], *["-"] * 9)
            continue
        compute, outside, bound = row["compute"].get("step_s"), row["outside"].get("step_s"), row.get("bound_s")
        table.add_row(str(row["kv_bits"]), f"{row['kv_bytes_per_token']:,}", str(row["batch"]),
                      f"{row['batch'] / base['batch']:.2f}x" if base else "-", f"{row['peak_bytes'] / 1e9:.2f}",
                      f"{row['step_s']:.3f}", f"{row['tokens_per_s']:.0f}", f"{outside:.3f}" if outside else "-",
                      f"{compute:.3f}" if compute else "-", f"{bound:.3f}" if bound else "-",
                      f"{row['step_s'] / bound:.2f}x" if bound else "-",
                      f"{outside / bound:.2f}x" if bound and outside else "-")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"memory_limit": args.memory_limit, "model": MODEL_CONFIG,
                                         "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                                         "read_pass_s": read_s, "runs": rows, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
