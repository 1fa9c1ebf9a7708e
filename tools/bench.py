"""zerolite beside the other ways to run a model that does not fit: one model, batch and new-token
count, every contender in a fresh process, the page cache dropped before each. Run as root.

    pip install -e '.[bench]'      # DeepSpeed (its NVMe path also needs: apt-get install libaio-dev), llama.cpp
    python tools/bench.py --source build/llama19/source --layout build/llama19/layout \
        --batch-size 16 --new-tokens 16 [--contenders zerolite-nvme,transformers-ram,...] \
        [--repeat 5] [--memory-limit 1.5GB] [--json out.json]

With --make-model, a missing --source is first built from the benchmark's config (a 1.9 GB bf16
Llama: hidden 2048, 16 layers, intermediate 5632, vocab 32000, 16 heads; random weights) and a
missing --layout converted from it.

Printed per contender: start-to-ready (process start to model ready: interpreter, imports,
loading), prefill, the median decode step (with --repeat N, each contender runs N times, taking
turns, and the figures are the medians over runs, with the decode step's spread: slowest run /
median), tokens/s over the whole generate, ms per token (the seeds' metric: wall time / (batch x
new tokens)), ratios to zerolite --offload nvme, the decode step against the bound, bytes read,
peak RSS, and whether its tokens equal transformers' in RAM.

The bound per decode step is max(disk, compute). The disk: a read-only pass of our own engine over
the layers zerolite --offload nvme --cpu-memory 0 streams, in decode order, with no compute, once
per decode step, run in each round with the page cache dropped first, like the contenders (a cold
read is no bound: on virtual disks the host caches below the guest, and decode's repeated reads run
far faster). fio's cold sequential read of the layout is printed beside it where fio is installed.
The compute: transformers' decode step with every weight in RAM (with --memory-limit, from one
more run of it, outside the limit); for an int8 or int4 contender, zerolite-cpu-SCHEME's step where
that contender ran (the quantized kernels' compute, not a bf16 matmul's), else transformers'.

The llama.cpp contenders (llamacpp-bf16, llamacpp-q4_0, llamacpp-q8_0) run GGUF files of --source made by
tools/bench_gguf.py before the first round and kept in --scratch's folder for later runs. Their
tokens come from other kernels (and, for q4_0 and q8_0, other weights): beside them is the share of new
tokens equal to transformers' up to each row's first difference (greedy decoding goes on from its
own tokens, so what follows a difference is no longer comparable). q4_0 and q8_0 have no bound: no read-only
pass is run over weights of their sizes.

--memory-limit SIZE runs each contender in a memory cgroup of that size (v2 where available, else
v1; swap limited too): below the model's size, contenders that lean on the page cache meet the
disk as they do when the model really does not fit. One killed by the OOM killer is reported so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from bench_cgroup import MemoryCgroup, parse_limit
from bench_gguf import gguf_folder, make_gguf
from bench_io import fio_gbps
from models import make_model
from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT
from zerolite.layout.folder import Layout
from zerolite.layout.read_pass import read_pass
from zerolite.planner.machine import DISK_READ_BYTES, drop_page_cache
from zerolite.runtime.policy import Policy
from zerolite.torch_env import environment_as_the_user_had_it

HERE = Path(__file__).resolve().parent
DEFAULT_CONTENDERS = ["zerolite-nvme", "zerolite-nvme-half", "zerolite-cpu", "transformers-ram",
                      "deepspeed-nvme", "deepspeed-cpu", "accelerate-disk"]
BASELINE = "zerolite-nvme"
REFERENCE = "transformers-ram"  # every weight in RAM: its decode step is the compute bound
BENCH_CONFIG = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, vocab_size=32000,
                    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
FIO_CHUNK, FIO_DEPTH = 1 << 20, 32  # the engine's defaults


# Contenders whose name ends in -SCHEME run the same model converted with these convert arguments,
# from --SCHEME-layout.
QUANTIZED = {"int8": dict(weights="int8"), "int4": dict(weights="int4", group_size=32)}  # 32: as Q4_0
LLAMACPP = "llamacpp-"  # contenders whose name starts so run the GGUF file of the weights named after it


def scheme_of(name: str) -> str | None:
    """The quantized scheme a contender runs, or None for the layout's dtype."""
    suffix = name.rpartition("-")[2]
    return suffix if suffix in QUANTIZED else None


def at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of runs (1 or more)")
    return int(text)


def memory_limit(text: str) -> int:
    try:
        return parse_limit(text)
    except ZeroliteError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="the model as a transformers folder (safetensors)")
    parser.add_argument("--layout", required=True, help="the same model converted by zerolite")
    for scheme, convert_args in QUANTIZED.items():
        how = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in convert_args.items())
        parser.add_argument(f"--{scheme}-layout", default=None, help=f"the same model converted with {how}, for the "
                            f"*-{scheme} contenders (default: the --layout folder's name with -{scheme})")
    parser.add_argument("--make-model", action="store_true", help="build the benchmark model and layouts if missing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS))
    parser.add_argument("--repeat", type=at_least_one, default=1,
                        help="runs of each contender (taking turns); medians are shown")
    parser.add_argument("--memory-limit", type=memory_limit, default=None,
                        help="run each contender in a memory cgroup of this size (1.5GB, 1536MiB)")
    parser.add_argument("--scratch", default=None, help="folder for DeepSpeed's NVMe swap and accelerate's offload, "
                        "in a temporary folder made in it, and for the llama.cpp contenders' GGUF files, kept "
                        "(default: the folder --layout is in)")
    parser.add_argument("--llamacpp-plain", action="store_true",
                        help="llama.cpp without its repacked weights (AMX, AVX-512 interleaved): where they crash")
    parser.add_argument("--llamacpp-in-ram", action="store_true",
                        help="llama.cpp reads its whole file into RAM while loading (no mmap), as zerolite's "
                        "offload cpu does: its prefill then reads nothing from disk")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one contender may take")
    parser.add_argument("--json", default=None, help="write every figure here too")
    return parser


def folder_bytes(folder: Path) -> int:
    """What the files under folder hold (0 where it is not): what a run wrote there."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.exists() else 0


def run_contender(name: str, args, half_bytes: int, scratch: str, limit: int | None) -> dict:
    out = Path(scratch) / f"{name}.json"
    out.unlink(missing_ok=True)  # a result left by the round before is not this run's
    command = [sys.executable, str(HERE / "bench_contenders.py"), name,
               "--source", args.source, "--layout", args.layout,
               *(word for scheme in QUANTIZED for word in (f"--{scheme}-layout", getattr(args, f"{scheme}_layout"))),
               "--gguf-folder", args.gguf_folder,
               "--device", args.device, "--batch-size", str(args.batch_size), "--new-tokens", str(args.new_tokens),
               "--prompt-tokens", str(args.prompt_tokens), "--half-bytes", str(half_bytes), "--scratch", scratch,
               *(["--layers", str(args.layers)] if getattr(args, "layers", None) else []),
               *(["--llamacpp-plain"] if args.llamacpp_plain else []),
               *(["--llamacpp-in-ram"] if args.llamacpp_in_ram else []),
               "--out", str(out), "--started", str(time.time())]
    cgroup = MemoryCgroup.create(name, limit) if limit else None
    drop_page_cache()
    try:
        # zerolite's contenders run as zerolite sets their threads (zerolite/openmp.py); the others
        # as the user's environment has it.
        env = dict(os.environ) if name.startswith("zerolite") else environment_as_the_user_had_it()
        done = subprocess.run(cgroup.wrap(command) if cgroup else command, capture_output=True, text=True,
                              timeout=args.timeout, check=False, env=env)
        oom_kills = cgroup.oom_kills() if cgroup else 0
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"timed out after {args.timeout} s"}
    finally:
        if cgroup:
            cgroup.remove()
    if done.returncode != 0 or not out.is_file():
        if oom_kills:
            return {"name": name, "oom_killed": True,
                    "error": f"killed by the OOM killer inside its {limit / 1e9:.2f} GB memory limit"}
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"name": name, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(out.read_text())


def fio_cold_gbps(layout: Layout) -> float | None:
    """fio's cold sequential O_DIRECT read of the layout's weights (in place: of its largest shard);
    None without fio."""
    if not shutil.which("fio"):
        return None
    path = max(layout.read_paths, key=lambda p: p.stat().st_size)
    size = min(path.stat().st_size, DISK_READ_BYTES) // ALIGNMENT * ALIGNMENT
    drop_page_cache()
    return round(fio_gbps(str(path), size, FIO_CHUNK, FIO_DEPTH), 3)


def main() -> None:
    args = build_parser().parse_args()
    for scheme in QUANTIZED:
        folder = (getattr(args, f"{scheme}_layout")
                  or str(Path(args.layout).with_name(f"{Path(args.layout).name}-{scheme}")))
        setattr(args, f"{scheme}_layout", folder)
    console = Console(width=None if sys.stdout.isatty() else 200)  # the table stays whole in a log
    if args.make_model:
        quantized_layouts = {Path(getattr(args, f"{scheme}_layout")): convert_args
                             for scheme, convert_args in QUANTIZED.items()}
        make_model(Path(args.source), "llama", BENCH_CONFIG, {Path(args.layout): {}, **quantized_layouts})

    layout = Layout.open(args.layout)
    manifest = layout.manifest
    layers = list(manifest.layer_names)  # what zerolite --offload nvme --cpu-memory 0 streams at every step
    layer_bytes = sorted(manifest.block(name).length for name in layers)
    half_bytes = sum(layer_bytes[: len(layer_bytes) // 2])
    streamed = sum(layer_bytes)
    decode_steps = max(args.new_tokens - 1, 1)
    fio = fio_cold_gbps(layout)
    limit = f", each contender in a {args.memory_limit / 1e9:.2f} GB memory cgroup" if args.memory_limit else ""
    console.print(f"layers {streamed / 1e9:.2f} GB; batch {args.batch_size}, {args.prompt_tokens}-token prompts, "
                  f"{args.new_tokens} new tokens; {args.repeat} run(s) of each{limit}", highlight=False)

    runs = {name: [] for name in args.contenders.split(",")}
    # A quantized contender reads its own layout: its disk bound is a read-only pass over that layout's layers.
    quantized = {scheme: Layout.open(getattr(args, f"{scheme}_layout"))
                 for scheme in dict.fromkeys(filter(None, map(scheme_of, runs)))}
    scratch_root = Path(args.scratch) if args.scratch else Path(args.layout).resolve().parent
    args.gguf_folder = str(gguf_folder(Path(args.source), scratch_root))
    for name in runs:
        if name.startswith(LLAMACPP):
            gguf = make_gguf(Path(args.source), Path(args.gguf_folder), name.removeprefix(LLAMACPP))
            console.print(f"{name}: {gguf}", highlight=False)
    passes, quantized_passes = [], {scheme: [] for scheme in quantized}
    with tempfile.TemporaryDirectory(dir=scratch_root, prefix="bench-") as scratch:
        for round_ in range(args.repeat):
            drop_page_cache()
            passes.append(read_pass(layout, layers, passes=decode_steps, depth=Policy().prefetch_depth))
            console.print(f"round {round_ + 1}: read-only pass {passes[-1]['median_pass_s']:.3f} s per step "
                          f"({passes[-1]['read_gbps']:.2f} GB/s)", highlight=False)
            for scheme, scheme_layout in quantized.items():
                drop_page_cache()
                quantized_passes[scheme].append(read_pass(scheme_layout, list(scheme_layout.manifest.layer_names),
                                                          passes=decode_steps, depth=Policy().prefetch_depth))
                console.print(f"round {round_ + 1}: read-only pass of the {scheme} layout "
                              f"{quantized_passes[scheme][-1]['median_pass_s']:.3f} s per step", highlight=False)
            for name in runs:
                console.print(f"running {name} ...")
                runs[name].append(run_contender(name, args, half_bytes, scratch, args.memory_limit))
                if "error" in runs[name][-1]:
                    console.print(f"  {name}: {runs[name][-1]['error']}", highlight=False)
        if args.memory_limit:
            # The compute bound is a step with every weight in RAM: inside the limit the reference
            # would page its weights in from disk, so it runs once more, unlimited.
            console.print(f"running {REFERENCE} without the memory limit, for the compute bound ...")
            compute = summarise(REFERENCE, [run_contender(REFERENCE, args, half_bytes, scratch, None)], args)
        else:
            compute = None
    results = {name: summarise(name, done, args) for name, done in runs.items()}
    reference = compute or results.get(REFERENCE, {})
    bound = bounds(passes, fio, reference, streamed)
    # A quantized layout's compute is its own kernels', not a bf16 matmul's: its in-RAM run
    # (zerolite-cpu-SCHEME), where that contender ran, is its compute bound.
    quantized_bounds = {}
    for scheme, scheme_layout in quantized.items():
        in_ram = f"zerolite-cpu-{scheme}"
        compute_of = in_ram if "error" not in results.get(in_ram, {"error": "not run"}) else REFERENCE
        quantized_bounds[scheme] = {
            **bounds(quantized_passes[scheme], None, results[in_ram] if compute_of == in_ram else reference,
                     scheme_layout.manifest.nbytes(scheme_layout.manifest.layer_names)),
            "compute_of": compute_of,
        }
    report(console, results, args, bound, manifest.data_bytes, quantized_bounds)
    if args.json:
        Path(args.json).write_text(json.dumps({"layer_bytes": streamed, "memory_limit_bytes": args.memory_limit,
                                               "repeat": args.repeat, "bound": bound, "read_passes": passes,
                                               "quantized_bounds": quantized_bounds,
                                               "quantized_read_passes": quantized_passes,
                                               "unlimited_reference": compute, "results": results}, indent=2))


def summarise(name: str, runs: list[dict], args) -> dict:
    """One contender's figures: medians over its runs that finished; every run kept."""
    tokens = args.batch_size * args.new_tokens
    finished = [r for r in runs if "error" not in r]
    for r in finished:
        r["decode_step_s"] = statistics.median(r["step_s"]) if r["step_s"] else None
        r["tokens_per_s"] = tokens / r["generate_s"]
        r["ms_per_token"] = 1e3 * r["generate_s"] / tokens
    summary = {"name": name, "runs": runs, "failed_runs": len(runs) - len(finished)}
    if not finished:
        summary["error"] = runs[-1]["error"]
        summary["oom_killed"] = any(r.get("oom_killed") for r in runs)
        return summary
    steps = [r["decode_step_s"] for r in finished if r["decode_step_s"] is not None]
    for key in ("ready_s", "prefill_s", "tokens_per_s", "ms_per_token", "peak_rss_bytes", "bytes_read"):
        if all(key in r for r in finished):
            summary[key] = statistics.median(r[key] for r in finished)
    summary["decode_step_s"] = statistics.median(steps) if steps else None
    summary["decode_step_spread"] = max(steps) / statistics.median(steps) if steps else None  # slowest run / median
    summary["tokens"] = finished[0]["tokens"]
    return summary


def bounds(passes: list[dict], fio: float | None, reference: dict, streamed: int) -> dict:
    """Per decode step: the read-only pass (median over rounds of each round's median pass), the
    compute of transformers in RAM (reference: its summary), and the larger of the two."""
    disk_s = statistics.median(p["median_pass_s"] for p in passes)
    compute_s = reference.get("decode_step_s")
    return {"read_pass_s": disk_s, "read_pass_gbps": round(streamed / disk_s / 1e9, 3),
            "read_pass_spread": max(p["median_pass_s"] for p in passes) / disk_s,
            "fio_cold_gbps": fio, "fio_cold_s": streamed / (fio * 1e9) if fio else None,
            "compute_s": compute_s, "bound_s": max(disk_s, compute_s or 0.0)}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The share of new tokens equal to the reference's before each row's first difference."""
    same = 0
    for row, expected in zip(tokens, reference):
        same += next((i for i, (a, b) in enumerate(zip(row, expected)) if a != b), len(row))
    return same / sum(len(row) for row in tokens)


def report(console: Console, results: dict, args, bound: dict, model_bytes: int,
           quantized_bounds: dict[str, dict]) -> None:
    finished = {name: r for name, r in results.items() if "error" not in r}
    base, reference = finished.get(BASELINE), finished.get(REFERENCE)
    title = "tools/bench: same model, batch and new tokens; page cache dropped before each contender"
    if args.repeat > 1:
        title += f"; medians of {args.repeat} runs"
    table = Table(title=title)
    columns = ["contender", "ready s", "prefill s", "decode step s", "step spread", "tokens/s", "ms/token",
               "tokens/s vs zerolite", "ready vs zerolite", "step vs bound", "GB read", "peak RSS GB", "same tokens"]
    for column in columns:
        table.add_column(column, justify="left" if column == "contender" else "right")
    for name, r in results.items():
        if "error" in r:
            table.add_row(name, *["-"] * (len(columns) - 2), "OOM-killed" if r["oom_killed"] else "failed")
            continue
        scheme = scheme_of(name)
        if scheme:
            same = f"{scheme}: tests compare it"  # other weights, other logits: compared in tests/test_quantized.py
        elif reference is None:
            same = "-"
        elif r["tokens"] == reference["tokens"]:
            same = "yes"
        elif name.startswith(LLAMACPP):
            same = f"{agreement(r['tokens'], reference['tokens']):.0%} to 1st diff"
        else:
            same = "NO"
        if r["failed_runs"]:
            same += f" ({r['failed_runs']} of {len(r['runs'])} runs failed)"
        step = r["decode_step_s"]
        if name in (LLAMACPP + "q4_0", LLAMACPP + "q8_0"):
            own_bound = None
        else:
            own_bound = quantized_bounds[scheme] if scheme else bound
        table.add_row(
            name, f"{r['ready_s']:.1f}", f"{r['prefill_s']:.2f}", f"{step:.3f}", f"{r['decode_step_spread']:.2f}x",
            f"{r['tokens_per_s']:.2f}", f"{r['ms_per_token']:.0f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
            f"{r['ready_s'] / base['ready_s']:.1f}x" if base else "-",
            f"{step / own_bound['bound_s']:.2f}x" if own_bound else "-",
            f"{r['bytes_read'] / 1e9:.1f}" if "bytes_read" in r else "-",
            f"{r['peak_rss_bytes'] / 1e9:.2f}", same,
        )
    console.print(table)
    disk = (f"disk per decode step: read-only pass {bound['read_pass_s']:.3f} s ({bound['read_pass_gbps']:.2f} GB/s, "
            f"spread {bound['read_pass_spread']:.2f}x over rounds); ")
    if bound["fio_cold_gbps"]:
        disk += f"fio's cold read {bound['fio_cold_gbps']:.2f} GB/s ({bound['fio_cold_s']:.3f} s), not the bound"
    else:
        disk += "fio not installed (apt-get install fio): no cold figure"
    console.print(disk, highlight=False)
    if bound["compute_s"]:
        console.print(f"bound per decode step: max(read-only pass {bound['read_pass_s']:.3f} s, compute "
                      f"{bound['compute_s']:.3f} s of transformers in RAM) = {bound['bound_s']:.3f} s", highlight=False)
    else:
        why = "did not finish" if REFERENCE in results else "was not among the contenders"
        console.print(f"bound per decode step: the read-only pass alone, {bound['bound_s']:.3f} s ({REFERENCE} {why}: "
                      "no compute figure)", highlight=False)
    if base:
        console.print(f"zerolite --offload nvme decode step: {base['decode_step_s']:.3f} s = "
                      f"{base['decode_step_s'] / bound['read_pass_s']:.2f}x the read-only pass, "
                      f"{base['decode_step_s'] / bound['bound_s']:.2f}x the bound", highlight=False)
    for scheme, scheme_bound in quantized_bounds.items():
        console.print(f"{scheme} layout: read-only pass {scheme_bound['read_pass_s']:.3f} s per step "
                      f"({scheme_bound['read_pass_gbps']:.2f} GB/s); "
                      f"its contenders' bound {scheme_bound['bound_s']:.3f} s "
                      f"(compute {scheme_bound['compute_s'] or 0:.3f} s of {scheme_bound['compute_of']})",
                      highlight=False)
    room = min(psutil.virtual_memory().total, args.memory_limit or float("inf"))
    if "accelerate-disk" in finished and model_bytes < room:
        console.print("accelerate-disk: the model fits in the memory it may use here, so after its first pass its "
                      "layer reads come from the page cache, not the disk", highlight=False)


if __name__ == "__main__":
    main()
