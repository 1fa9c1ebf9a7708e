"""A model larger than this machine's RAM, without a memory cgroup: a Llama-shaped bf16 model of
about 26 GB with random weights, written shard by shard (never held whole), then run by zerolite in
place and by its contenders, each in a fresh process after the page cache is dropped. Run as root.

    python tools/bench_scale.py [--folder /work/scale] [--new-tokens 4] [--keep] [--json out.json]
        [--runs in-place-b1,in-place-b16,in-place-stream-b1,in-place-stream-b16,read-pass,accelerate,int4]

Runs (--runs picks some):
  in-place-b1, in-place-b16              zerolite in place, default budgets, batch 1 and 16
  in-place-stream-b1, in-place-stream-b16  the same with --cpu-memory 0: every layer streamed
  in-place-planned-b1, in-place-planned-b16  the host budget zerolite generate takes for this job
                                         (zerolite plan's search: batch prompts, --new-tokens each)
  read-pass                              a read-only pass of the engine over the layers, in decode order
  accelerate                             transformers + accelerate disk offload (device_map="auto",
                                         an 18 GiB host budget), batch 1
  int4                                   converted to int4 (time, peak RSS), then streamed at batch 16
  compute                                the in-memory compute of a decode step at batch 1 and 16: the
                                         model's own modules with 2 and with 6 layers in RAM, no reads,
                                         scaled to all its layers by the difference
  convert                                a plain copy of the shards, then convert into a bf16 layout and
                                         into int4: throughput of each beside the copy's, convert's peak
                                         RSS (all deleted after; the int4 layout kept for the int4 run)

Reported for each: time to first token (from process start), the median decode step, peak RSS
and the disk it used; the steps beside the read pass, and beside their bound: the slower of the read
pass's share for the layers a run streams and the in-memory compute of its step; and for zerolite's runs the
decode step zerolite plan predicts for the policy each ran (its batch, weights and the layers it
held), from the machine's figures as recorded before the runs. Everything written is
deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench import folder_bytes, run_contender
from bench_convert import plain_copy, timed_convert
from zerolite.planner.machine import drop_page_cache

SCALE_CONFIG = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                    num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
LAYERS_PER_SHARD = 2
RUNS = {
    "in-place-b1": ("zerolite-in-place-default", 1),
    "in-place-b16": ("zerolite-in-place-default", 16),
    "in-place-stream-b1": ("zerolite-nvme-in-place", 1),
    "in-place-stream-b16": ("zerolite-nvme-in-place", 16),
    "in-place-planned-b1": ("zerolite-in-place-planned", 1),
    "in-place-planned-b16": ("zerolite-in-place-planned", 16),
    "accelerate": ("accelerate-auto", 1),
    "int4": ("zerolite-nvme-int4", 16),
}
ALL_RUNS = [*RUNS, "read-pass", "compute", "convert"]
COMPUTE_LAYERS = (2, 6)  # decoder layers of the two in-memory models whose steps give one layer's compute


def write_model(source: Path, console: Console) -> int:
    """The model, one safetensors shard per LAYERS_PER_SHARD layers, random normal weights (std
    0.02, norms at 1), saved under the names transformers loads; returns its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **SCALE_CONFIG, dtype="bfloat16")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    names = {name: tuple(p.shape) for name, p in meta.state_dict().items()}
    groups: list[list[str]] = [[n for n in names if not n.startswith("model.layers.")]]
    for first in range(0, config.num_hidden_layers, LAYERS_PER_SHARD):
        prefixes = tuple(f"model.layers.{i}." for i in range(first, first + LAYERS_PER_SHARD))
        groups.append([n for n in names if n.startswith(prefixes)])
    source.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, group in enumerate(groups):
        shard = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            shape = names[name]
            tensors[name] = (torch.ones(shape) if name.endswith("norm.weight") else
                             torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        save_file(tensors, source / shard, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(group, shard))
        console.print(f"wrote {shard} ({total / 1e9:.1f} GB so far)", highlight=False)
        del tensors
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}, indent=1))
    config.save_pretrained(source)
    return total


def read_pass_step(layout_folder: Path, passes: int) -> float:
    """The median seconds of one read-only pass over the layers, cold cache first."""
    from zerolite.layout.folder import Layout
    from zerolite.layout.read_pass import read_pass
    from zerolite.runtime.policy import Policy

    layout = Layout.open(layout_folder)
    drop_page_cache()
    return read_pass(layout, list(layout.manifest.layer_names), passes=passes,
                     depth=Policy().prefetch_depth)["median_pass_s"]


def plan_predictor(source: Path, args):
    """predict(batch, weights, held layers) -> zerolite plan's decode step for that policy, from
    what is recorded of this machine now (the disk's rate, compute probed once)."""
    from zerolite.planner.cost import Candidate, Job, predict
    from zerolite.planner.for_job import model_and_machine
    from zerolite.planner.model_source import ModelSource

    costs, hardware = model_and_machine(ModelSource.resolve(str(source), None, None), "cpu")

    def step(batch: int, weights: str, held: int, depth: int) -> float:
        job = Job(args.prompt_tokens, args.new_tokens, batch)
        return predict(costs, hardware, Candidate(weights, batch, held, prefetch_depth=depth), job).decode_step_s

    return step


def convert_beside_a_copy(source: Path, scratch: Path, int4_folder: Path, console: Console) -> dict:
    """A plain copy of the shards, then convert into bf16 and into int4, each from a cold cache:
    seconds, throughput against the copy's (the same source bytes), convert's peak RSS."""
    copy = scratch / "copy"
    copy.mkdir()
    drop_page_cache()
    copy_s = plain_copy(sorted(source.glob("*.safetensors")), copy)
    shutil.rmtree(copy)
    result = {"copy_s": copy_s}
    for weights, folder in ((None, scratch / "layout"), ("int4", int4_folder)):
        shutil.rmtree(folder, ignore_errors=True)
        drop_page_cache()
        seconds, rss = timed_convert(str(source), folder, weights)
        written = folder_bytes(folder)
        if weights is None:
            shutil.rmtree(folder)
        name = weights or "bf16"
        result[name] = {"convert_s": seconds, "peak_rss_bytes": rss, "disk_bytes": written,
                        "throughput_vs_copy": copy_s / seconds}
        console.print(f"convert {name}: {seconds:.0f} s beside a plain copy's {copy_s:.0f} s "
                      f"({copy_s / seconds:.2f}x its throughput), peak RSS {rss / 1e9:.2f} GB, "
                      f"{written / 1e9:.1f} GB written", highlight=False)
    return result


def compute_in_ram(args, batch: int, scratch: str) -> dict:
    """The decode step's compute with every weight in memory, no reads: the median step of the model
    built with COMPUTE_LAYERS layers in RAM, scaled to all of them by the per-layer difference."""
    steps = {}
    for layers in COMPUTE_LAYERS:
        args.batch_size, args.layers = batch, layers
        result = run_contender("zerolite-compute-in-ram", args, 0, scratch, None)
        if "error" in result:
            args.layers = None
            return {"error": f"with {layers} layers: {result['error']}"}
        steps[layers] = statistics.median(result["step_s"])
    few, many = COMPUTE_LAYERS
    layer_s = (steps[many] - steps[few]) / (many - few)
    args.layers = None
    return {"step_s_by_layers": steps, "layer_s": layer_s,
            "step_s": steps[many] + (SCALE_CONFIG["num_hidden_layers"] - many) * layer_s}


def bound_columns(result: dict, run: str, step: float, read_pass: float | None, compute: dict | None) -> list[str]:
    """The bound of a zerolite bf16 run's step, the slower of its streamed layers' share of the read pass
    and the in-memory compute at its batch, and the step against it (int4's compute is not measured in
    memory; accelerate does not say which layers it holds)."""
    held, batch = result.get("held_layers"), RUNS[run][1]
    if read_pass is None or compute is None or batch not in compute or run == "int4" or held is None:
        return ["-", "-"]
    layers = SCALE_CONFIG["num_hidden_layers"]
    bound = max(read_pass * (layers - held) / layers, compute[batch]["step_s"])
    result["bound_s"] = bound
    return [f"{bound:.2f}", f"{step / bound:.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("/work/scale"))
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--runs", default=",".join(ALL_RUNS))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--keep", action="store_true", help="keep the model and what was made from it")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = args.runs.split(",")
    unknown = [run for run in runs if run not in ALL_RUNS]
    if unknown:
        parser.error(f"unknown run {unknown[0]!r}; known: {', '.join(ALL_RUNS)}")
    console = Console(width=None if sys.stdout.isatty() else 160)
    source, scratch = args.folder / "source", args.folder / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    if not (source / "config.json").is_file():
        started = time.perf_counter()
        nbytes = write_model(source, console)
        console.print(f"model written: {nbytes / 1e9:.1f} GB in {time.perf_counter() - started:.0f} s", highlight=False)
    args.source, args.layout, args.device, args.gguf_folder = str(source), str(source), "cpu", ""
    args.int8_layout, args.int4_layout = "", str(args.folder / "int4")
    predictor = plan_predictor(source, args)
    results = {}
    try:
        if "convert" in runs:
            results["convert"] = convert_beside_a_copy(source, scratch, args.folder / "int4", console)
        if "compute" in runs:
            results["compute"] = {batch: compute_in_ram(args, batch, str(scratch)) for batch in (1, 16)}
            for batch, compute in results["compute"].items():
                console.print(f"in-memory compute at batch {batch}: " + (compute.get("error") or
                              f"{compute['step_s']:.2f} s a step ({compute['layer_s'] * 1e3:.1f} ms a layer)"),
                              highlight=False)
            results["compute"] = {batch: c for batch, c in results["compute"].items() if "error" not in c}
        for run in runs:
            if run in ("read-pass", "compute", "convert"):
                continue
            if run == "int4" and not (args.folder / "int4").exists():
                seconds, rss = timed_convert(str(source), args.folder / "int4", "int4")
                results["int4 convert"] = {"convert_s": seconds, "peak_rss_bytes": rss,
                                           "disk_bytes": folder_bytes(args.folder / "int4")}
                console.print(f"int4 convert: {seconds:.0f} s, peak RSS {rss / 1e9:.2f} GB", highlight=False)
            name, batch = RUNS[run]
            args.batch_size = batch
            result = run_contender(name, args, 0, str(scratch), None)
            result["disk_bytes"] = folder_bytes(scratch / "in-place") + folder_bytes(scratch / "accelerate-offload")
            results[run] = result
            summary = result.get("error") or (f"first token {result['ready_s'] + result['prefill_s']:.1f} s, "
                                              f"decode step {statistics.median(result['step_s']):.2f} s")
            console.print(f"{run}: {summary}", highlight=False)
        if "read-pass" in runs:
            folder = next((scratch / "in-place").glob("*"), None) if (scratch / "in-place").exists() else None
            if folder is None:
                from zerolite.convert.resolve import ensure_layout

                folder = ensure_layout(str(source), scratch / "in-place", None, False, False)
            results["read-pass"] = {"step_s": [read_pass_step(folder, max(args.new_tokens - 1, 1))]}
            console.print(f"read-only pass: {results['read-pass']['step_s'][0]:.2f} s per step", highlight=False)
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)
    table = Table(title=f"a {SCALE_CONFIG['num_hidden_layers']}-layer Llama of hidden "
                        f"{SCALE_CONFIG['hidden_size']} in bf16, {args.new_tokens} new tokens, "
                        "page cache dropped before each run")
    for column in ("run", "batch", "held layers", "depth", "first token s", "decode step s", "plan predicts s",
                   "step / read pass", "bound s", "step / bound", "peak RSS GB", "disk GB"):
        table.add_column(column, justify="left" if column == "run" else "right")
    read_pass = results.get("read-pass", {}).get("step_s", [None])[0]
    for run, result in results.items():
        if run in ("read-pass", "int4 convert", "convert", "compute") or "error" in result:
            continue
        step = statistics.median(result["step_s"]) if result["step_s"] else float("nan")
        held = result.get("held_layers")
        if held is not None:
            result["predicted_step_s"] = predictor(RUNS[run][1], "int4" if run == "int4" else "stored", held,
                                                   result["prefetch_depth"])
        table.add_row(run, str(RUNS[run][1]), "-" if held is None else str(held),
                      str(result.get("prefetch_depth", "-")), f"{result['ready_s'] + result['prefill_s']:.1f}",
                      f"{step:.2f}", f"{result['predicted_step_s']:.2f}" if held is not None else "-",
                      f"{step / read_pass:.2f}x" if read_pass else "-",
                      *bound_columns(result, run, step, read_pass, results.get("compute")),
                      f"{result['peak_rss_bytes'] / 1e9:.1f}",
                      f"{result['disk_bytes'] / 1e9:.3f}")
    console.print(table)
    for run, result in results.items():
        if "error" in result:
            console.print(f"{run}: {result['error']}", highlight=False)
    if "int4 convert" in results and results["int4 convert"]["convert_s"]:
        c = results["int4 convert"]
        console.print(f"int4 convert: {c['convert_s']:.0f} s, peak RSS {c['peak_rss_bytes'] / 1e9:.2f} GB, "
                      f"{c['disk_bytes'] / 1e9:.1f} GB written", highlight=False)
    if args.json:
        kept = {run: {k: v for k, v in r.items() if k != "tokens"} for run, r in results.items()}
        Path(args.json).write_text(json.dumps(kept, indent=1))


if __name__ == "__main__":
    main()
