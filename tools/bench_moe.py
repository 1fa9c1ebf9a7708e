"""A mixture of experts streamed per expert (--experts routed) against the same model streamed whole
(--experts whole): bytes per decode step, tokens/s and the tokens, at each batch size. Run as root
(the page cache is dropped before each run).

    python tools/bench_moe.py --source build/mixtral2g/source --layout build/mixtral2g/layout --make-model \
        [--batch-sizes 1,16] [--new-tokens 24] [--json out.json]

With --make-model, a missing --source is first built (a 1.94 GB bf16 Mixtral-shaped model: hidden
1024, 10 layers, 8 experts of intermediate 3584, top-2, vocab 32000; random weights, so a random
router) and a missing --layout converted from it.

Each run is a fresh process streaming every layer from disk at every step (--offload nvme
--cpu-memory 0 --device cpu), batch B of random 16-token prompts (seed 0), greedy. Per decode step
it records the bytes read, and, from a hook of its own on every experts module, the experts the
router picked (the union over the batch), so that the bytes a step should read are known apart
from what zerolite counted: per layer its dense part plus one extent per routed expert. The
prefill is left out of the per-step figures (a prompt's tokens route to nearly every expert).

The disk's own bound, in the same run: a read-only pass of our engine, cold, with no compute, over
what the decode steps read (each layer's dense part and the experts its router picked, in step
order) against one over whole layers for as many steps. Its ratio is the speed-up the disk allows:
scattered expert extents may read slower than whole layers in sequence (on virtual disks whose
host reads ahead, markedly so).

With --pairs N, each batch size runs whole, routed, whole, ... (N routed runs, N + 1 whole ones),
and each routed run's speed-up is against the mean of the whole runs on either side of it: the
disk's speed drifts between runs (whole runs of one session: 1.09 to 1.48 tokens/s), and a
single pair puts that drift into the ratio. The median speed-up is reported, with every pair's.
The bytes, routing and guesses are those of the first routed run; every run's tokens are compared.

Printed: per batch size and mode, decode tokens/s (every run), the read-only pass (and its ratio),
the median decode step's bytes (dense and experts), what the routing says it should read, the ratio
to dense + k/E of the experts (batch 1), the guess rate of the next-layer prefetch, and whether the
tokens equal the whole-layer run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import zerolite  # first: it sets torch's thread waits before torch loads (zerolite.openmp)

# isort: split
import torch
from rich.console import Console
from rich.table import Table

from models import make_model
from zerolite.generate.stats import StepClock
from zerolite.io.engine import IoEngine
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import BlockEntry
from zerolite.layout.read_pass import read_pass
from zerolite.moe.experts import find_experts
from zerolite.planner.machine import drop_page_cache

MODEL_CONFIG = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=10, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=4096, tie_word_embeddings=False)
PROMPT_TOKENS = 16


class StepMeter(StepClock):
    """generate's step clock, noting at every step the bytes read and the experts routed since the step before."""

    def __init__(self, lm, routed: list[set[int]]):
        super().__init__(self.note)
        self.lm, self.routed = lm, routed
        self.steps: list[dict] = []
        # Counted from here, before generate: only the first step (the prefill, left out) differs from
        # counting from the prompt's put, which the clock does not hand on.
        self._last = (lm.bytes_read, lm.expert_counts())

    def note(self, tokens: int) -> None:
        bytes_read, experts = self.lm.bytes_read, self.lm.expert_counts()
        last_bytes, last_experts = self._last
        step = experts.since(last_experts)
        self.steps.append({"bytes": bytes_read - last_bytes, "expert_bytes": step.expert_bytes,
                           "early_unused": step.early_unused, "routed": [sorted(layer) for layer in self.routed]})
        for layer in self.routed:
            layer.clear()
        self._last = bytes_read, experts


def run_one(layout: str, experts: str, batch_size: int, new_tokens: int) -> dict:
    """One configuration, in this (fresh) process: per decode step its time, bytes and routing."""
    with zerolite.load(layout, offload="nvme", cpu_memory=0, device="cpu", experts=experts, show_progress=False) as lm:
        manifest = lm.layout.manifest
        layers = lm.model.get_submodule(manifest.layers_path)
        routed: list[set[int]] = []
        for layer in layers:
            found = find_experts(layer)
            union: set[int] = set()
            routed.append(union)
            layer.get_submodule(found.path).register_forward_pre_hook(  # before zerolite's, which may narrow them
                lambda module, args, union=union: union.update(args[1].flatten().tolist()), prepend=True)
        vocab = lm.model.config.vocab_size
        ids = torch.randint(3, vocab, (batch_size, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
        meter = StepMeter(lm, routed)
        before = lm.expert_counts()
        out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=meter)
        counts = lm.expert_counts().since(before)
        decode = meter.steps[1:]  # the first is the prefill
        step_s = [b - a for a, b in zip(meter.times[1:], meter.times[2:])]
        blocks = [manifest.block(name) for name in manifest.layer_names]
        area = blocks[0].experts
        dense = sum(b.dense_length if b.experts else b.length for b in blocks)
        expert_total = sum(b.length for b in blocks) - dense
        return {
            "experts": experts, "batch_size": batch_size, "new_tokens": new_tokens,
            "tokens": out[:, PROMPT_TOKENS:].tolist(),
            "decode_tokens_per_s": meter.decode_tokens / meter.decode_s,
            "step_s": [round(s, 4) for s in step_s],
            "bytes_per_step": [s["bytes"] for s in decode],
            "expert_bytes_per_step": [s["expert_bytes"] for s in decode],
            # what the routing says a step should read when it reads only the routed experts
            "routed_bytes_per_step": [dense + sum(map(len, s["routed"])) * area.stride for s in decode]
            if area else None,
            # and with the guessed experts read early that the router then did not pick
            "routed_and_unused_bytes_per_step": [dense + (sum(map(len, s["routed"])) + s["early_unused"]) * area.stride
                                                 for s in decode] if area else None,
            "routed_experts_per_step": [sum(map(len, s["routed"])) for s in decode],
            "routed": [s["routed"] for s in decode],  # per decode step, per layer: the experts picked
            "dense_bytes": dense, "expert_bytes": expert_total,
            "experts_per_layer": area.count if area else None,
            "guessed": counts.guessed, "guessed_right": counts.guessed_right,
        }


def read_only_pass(layout: Layout, steps: list[list[list[int]]] | None, count: int) -> float:
    """Seconds our engine takes to read, cold and with no compute, what count decode steps read:
    every layer whole, or (steps given) each layer's dense part and the experts its router picked,
    in the order a step reads them. The bound each mode's steps are held to on this disk."""
    names = list(layout.manifest.layer_names) * count
    if steps is not None:
        layout, names = routed_parts(layout, steps[:count])
    drop_page_cache()
    # Every step's reads as one pass through a ring of 8 buffers, on an engine 32 requests of 1 MiB deep.
    return read_pass(layout, names, passes=1, engine=IoEngine("auto", 32, 1 << 20), depth=8)["pass_s"][0]


def routed_parts(layout: Layout, steps: list[list[list[int]]]) -> tuple[Layout, list[str]]:
    """The layout as read_pass sees it when each layer's dense part and each of its experts is a
    block of its own (it reads whole blocks), and the parts the steps read, in order."""
    parts: dict[str, BlockEntry] = {}
    names = []
    for step in steps:
        for block, experts in zip(map(layout.manifest.block, layout.manifest.layer_names), step):
            dense = f"{block.name}.dense"
            parts[dense] = BlockEntry(dense, block.offset, block.dense_length, block.experts.dense_crc32, ())
            names.append(dense)
            for expert in experts:
                start, length = block.experts.extent(expert)
                name = f"{block.name}.expert{expert}"
                parts[name] = BlockEntry(name, block.offset + start, length, block.experts.crc32s[expert], ())
                names.append(name)
    return Layout(layout.folder, replace(layout.manifest, blocks=tuple(parts.values()))), names


def measured(args, experts: str, batch_size: int) -> dict:
    if not drop_page_cache():
        sys.exit("bench_moe: run as root: the page cache must be dropped before each run")
    done = subprocess.run([sys.executable, __file__, "--run", experts, "--layout", str(args.layout),
                           "--batch-sizes", str(batch_size), "--new-tokens", str(args.new_tokens)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"bench_moe: the {experts} run at batch {batch_size} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path("build/mixtral2g/source"))
    parser.add_argument("--layout", type=Path, default=Path("build/mixtral2g/layout"))
    parser.add_argument("--make-model", action="store_true")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=1, help="Routed runs per batch size, each between two whole runs.")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--run", choices=["routed", "whole"], help=argparse.SUPPRESS)  # one run, in a fresh process
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.run:
        print(json.dumps(run_one(str(args.layout), args.run, sizes[0], args.new_tokens)))
        return
    if args.make_model:
        make_model(args.source, "mixtral", MODEL_CONFIG, {args.layout: {}})
    layout = Layout.open(args.layout)

    results = []
    for batch_size in sizes:
        # Routed runs between whole ones (whole, routed, whole, ...): each routed run is set against
        # the mean of the whole runs beside it, since this disk's speed drifts from run to run.
        wholes, routeds = [measured(args, "whole", batch_size)], []
        for _ in range(args.pairs):
            routeds.append(measured(args, "routed", batch_size))
            if args.pairs > 1:
                wholes.append(measured(args, "whole", batch_size))
        whole, routed = wholes[0], routeds[0]
        results += [whole, routed]
        for r, runs in ((whole, wholes), (routed, routeds)):
            r["decode_tokens_per_s_runs"] = [run["decode_tokens_per_s"] for run in runs]
        routed["speedups"] = [run["decode_tokens_per_s"]
                              / statistics.mean(w["decode_tokens_per_s"] for w in wholes[i:i + 2])
                              for i, run in enumerate(routeds)]
        routed["speedup"] = statistics.median(routed["speedups"])
        routed["same_tokens_as_whole"] = all(run["tokens"] == whole["tokens"] for run in routeds + wholes)
        share = routed["experts_per_layer"] and 2 / routed["experts_per_layer"]  # top-2 of E
        routed["top_k_bound_bytes"] = routed["dense_bytes"] + share * routed["expert_bytes"]
        routed["bytes_over_top_k_bound"] = statistics.median(routed["bytes_per_step"]) / routed["top_k_bound_bytes"]
        routed["bytes_equal_routing"] = sum(a == b for a, b in zip(routed["bytes_per_step"],
                                                                   routed["routed_bytes_per_step"]))
        routed["bytes_equal_routing_and_unused"] = sum(
            a == b for a, b in zip(routed["bytes_per_step"], routed["routed_and_unused_bytes_per_step"]))
        # The disk's own speed-up bound: a read-only pass over what the routed steps needed against one
        # over whole layers, as many steps, in the same run.
        steps = len(routed["routed"])
        whole["read_only_s"] = read_only_pass(layout, None, steps)
        routed["read_only_s"] = read_only_pass(layout, routed["routed"], steps)
        routed["read_only_speedup"] = whole["read_only_s"] / routed["read_only_s"]

    table = Table(title=f"{args.layout}: streamed from disk at every step, "
                        f"decode steps of {args.new_tokens} new tokens")
    for column in ["batch", "experts", "tokens/s", "speed-up", "read-only pass", "GB/step (median)", "of it experts",
                   "routing says", "/ dense + 2/8", "steps = routing (+ early unused)", "guesses right",
                   "tokens = whole"]:
        table.add_column(column, justify="right")
    for r in results:
        routed = r["experts"] == "routed"
        median_bytes = statistics.median(r["bytes_per_step"])
        table.add_row(
            str(r["batch_size"]), r["experts"], " ".join(f"{rate:.2f}" for rate in r["decode_tokens_per_s_runs"]),
            (f"{r['speedup']:.2f}x"
             + (f" ({' '.join(f'{x:.2f}' for x in r['speedups'])})" if len(r["speedups"]) > 1 else ""))
            if routed else "1.00x",
            f"{r['read_only_s']:.2f} s" + (f" ({r['read_only_speedup']:.2f}x)" if routed else ""),
            f"{median_bytes / 1e9:.3f}",
            f"{statistics.median(r['expert_bytes_per_step']) / 1e9:.3f}" if routed else "-",
            f"{statistics.median(r['routed_bytes_per_step']) / 1e9:.3f}" if routed else "-",
            f"{r['bytes_over_top_k_bound']:.3f}" if routed else "-",
            f"{r['bytes_equal_routing']} ({r['bytes_equal_routing_and_unused']})/{len(r['bytes_per_step'])}"
            if routed else "-",
            f"{r['guessed_right']}/{r['guessed']}" if routed and r["guessed"] else "-",
            str(r["same_tokens_as_whole"]) if routed else "-",
        )
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
