"""zerolite beside the other ways to run a model that does not fit: one model, batch and new-token
count, every contender in a fresh process, the page cache dropped before each. Run as root.

    pip install -e '.[bench]'      # DeepSpeed; its NVMe path also needs: apt-get install libaio-dev
    python tools/bench.py --source build/llama19/source --layout build/llama19/layout \
        --batch-size 16 --new-tokens 16 [--contenders zerolite-nvme,transformers-ram,...] [--json out.json]

With --make-model, a missing --source is first built from the benchmark's config (a 1.9 GB bf16
Llama: hidden 2048, 16 layers, intermediate 5632, vocab 32000, 16 heads; random weights) and a
missing --layout converted from it.

Printed per contender: start-to-ready (process start to model ready: interpreter, imports,
loading), prefill, the median decode step, tokens/s over the whole generate, ms per token (the
seeds' metric: wall time / (batch x new tokens)), ratios to zerolite --offload nvme, bytes read,
and whether its tokens equal transformers' in RAM. Then the bound: max(disk, compute), the disk
from the layers' bytes and the read speed measured here (O_DIRECT, cold), the compute from
transformers' decode step with every weight in RAM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from zerolite.layout import Layout
from zerolite.machine import drop_page_cache, measure_disk

HERE = Path(__file__).resolve().parent
DEFAULT_CONTENDERS = ["zerolite-nvme", "zerolite-nvme-half", "zerolite-cpu", "transformers-ram",
                      "deepspeed-nvme", "deepspeed-cpu", "accelerate-disk"]
BASELINE = "zerolite-nvme"
BENCH_CONFIG = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, vocab_size=32000,
                    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)


def make_model(source: Path, layout: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerolite.convert import convert

    if not (source / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**BENCH_CONFIG)).to(torch.bfloat16)
        model.save_pretrained(source)
    if not (layout / "manifest.json").is_file():
        convert(str(source), layout)


def run_contender(name: str, args, half_bytes: int, scratch: str) -> dict:
    out = Path(scratch) / f"{name}.json"
    drop_page_cache()
    command = [sys.executable, str(HERE / "bench_contenders.py"), name, "--source", args.source, "--layout", args.layout,
               "--device", args.device, "--batch-size", str(args.batch_size), "--new-tokens", str(args.new_tokens),
               "--prompt-tokens", str(args.prompt_tokens), "--half-bytes", str(half_bytes), "--scratch", scratch,
               "--out", str(out), "--started", str(time.time())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0 or not out.is_file():
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"name": name, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="the model as a transformers folder (safetensors)")
    parser.add_argument("--layout", required=True, help="the same model converted by zerolite")
    parser.add_argument("--make-model", action="store_true", help="build the benchmark model and layout if missing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS))
    parser.add_argument("--scratch", default=None, help="folder for DeepSpeed's NVMe swap and accelerate's offload "
                        "(default: a temporary folder beside --layout, on its disk)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one contender may take")
    parser.add_argument("--json", default=None, help="write every figure here too")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)  # the table stays whole in a log
    if args.make_model:
        make_model(Path(args.source), Path(args.layout))

    manifest = Layout.open(args.layout).manifest
    layer_bytes = sorted(manifest.block(name).length for name in manifest.layer_names)
    half_bytes = sum(layer_bytes[: len(layer_bytes) // 2])
    streamed = sum(layer_bytes)
    read_gbps = statistics.median(measure_disk(args.layout)["read_gbps"] for _ in range(3))
    console.print(f"disk: {read_gbps:.2f} GB/s O_DIRECT (median of 3, cold); layers {streamed / 1e9:.2f} GB; "
                  f"batch {args.batch_size}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens")

    results = {}
    with tempfile.TemporaryDirectory(dir=Path(args.layout).resolve().parent, prefix="bench-") as scratch:
        for name in args.contenders.split(","):
            console.print(f"running {name} ...")
            results[name] = run_contender(name, args, half_bytes, scratch)
            if "error" in results[name]:
                console.print(f"  {name} failed: {results[name]['error']}", highlight=False)
    report(console, results, args, read_gbps, streamed, manifest.data_bytes)
    if args.json:
        Path(args.json).write_text(json.dumps({"read_gbps": read_gbps, "layer_bytes": streamed, "results": results}, indent=2))


def report(console: Console, results: dict, args, read_gbps: float, streamed: int, model_bytes: int) -> None:
    tokens = args.batch_size * args.new_tokens
    ok = {name: r for name, r in results.items() if "error" not in r}
    for r in ok.values():
        r["decode_step_s"] = statistics.median(r["step_s"]) if r["step_s"] else None
        r["tokens_per_s"] = tokens / r["generate_s"]
        r["ms_per_token"] = 1e3 * r["generate_s"] / tokens
    base = ok.get(BASELINE)
    reference = ok.get("transformers-ram")
    table = Table(title="tools/bench: same model, batch and new tokens; page cache dropped before each contender")
    for column in ("contender", "ready s", "prefill s", "decode step s", "tokens/s", "ms/token", "tokens/s vs zerolite",
                   "ready vs zerolite", "GB read", "same tokens"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for name, r in results.items():
        if "error" in r:
            table.add_row(name, *["-"] * 8, "failed")
            continue
        same = "-" if reference is None else ("yes" if r["tokens"] == reference["tokens"] else "NO")
        table.add_row(
            name, f"{r['ready_s']:.1f}", f"{r['prefill_s']:.2f}", f"{r['decode_step_s']:.3f}", f"{r['tokens_per_s']:.2f}",
            f"{r['ms_per_token']:.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
            f"{r['ready_s'] / base['ready_s']:.1f}x" if base else "-",
            f"{r['bytes_read'] / 1e9:.1f}" if "bytes_read" in r else "-", same,
        )
    console.print(table)
    disk_s = streamed / (read_gbps * 1e9)
    compute_s = reference["decode_step_s"] if reference else None
    line = f"bound per decode step: disk {disk_s:.3f} s ({streamed / 1e9:.2f} GB at {read_gbps:.2f} GB/s)"
    if compute_s:
        line += f", compute {compute_s:.3f} s (transformers in RAM): max {max(disk_s, compute_s):.3f} s"
    console.print(line, highlight=False)
    if base:
        console.print(f"zerolite --offload nvme decode step: {base['decode_step_s']:.3f} s = "
                      f"{base['decode_step_s'] / disk_s:.2f}x the disk bound"
                      + (f", {base['decode_step_s'] / max(disk_s, compute_s):.2f}x max(disk, compute)" if compute_s else ""),
                      highlight=False)
    if "accelerate-disk" in ok and model_bytes < psutil.virtual_memory().total:
        console.print("accelerate-disk: the model fits in RAM here, so after its first pass its layer reads come from "
                      "the page cache, not the disk", highlight=False)


if __name__ == "__main__":
    main()
