"""A mixture of experts streamed per expert (--experts routed) against the same model streamed whole
(--experts whole): bytes per decode step, tokens/s, the step against its bound, and the tokens, at
each batch size. Run as root (the page cache is dropped before each run).

    python tools/bench_moe.py [--shape mixtral|deepseek-v3] [--source FOLDER] [--layout FOLDER] [--make-model]
        [--in-place] [--batch-sizes 1,16] [--new-tokens 24] [--pairs 1] [--cpu-memory 0] [--json out.json]

Two model shapes, random bf16 weights (so a random router); with --make-model a missing --source is
first built and, unless --in-place, a missing --layout converted from it:
- mixtral (default; build/mixtral2g): 1.94 GB, hidden 1024, 10 layers, 8 experts of intermediate
  3584, top-2, vocab 32000; saved by transformers' save_pretrained.
- deepseek-v3 (build/dsv3): DeepSeek-V3's structure scaled down to 9.86 GB: hidden 2048, 16
  layers, the first dense (intermediate 6144), the others 64 routed experts of intermediate 768,
  top-8 with sigmoid scores limited to 4 of 8 groups, one shared expert, MLA (q_lora_rank 768,
  kv_lora_rank 256, rope 64 / nope 128 / v 128 per head, 16 heads), vocab 32000. Written as
  DeepSeek-V3's checkpoint is published (tools/models.py's write_checkpoint): one tensor per expert
  and projection (mlp.experts.N.gate_proj.weight, ...; mlp.shared_experts.*), shards of at most
  4.5 GB. Deterministic: delete it when done, --make-model writes the same bytes again.

--in-place streams the checkpoint's own shards (--source, alias --model): only a manifest is
planned, into --layout (default: the shape's folder's in-place/); a checkpoint zerolite cannot read
in place is said so, in one line, and nothing runs.

Each run is a fresh process streaming every layer from disk at every step (--offload nvme
--cpu-memory 0 --device cpu; --cpu-memory gives the host budget instead, which with per-expert
streaming becomes an expert cache once no whole layer fits), batch B of random 16-token prompts
(seed 0), greedy. Per decode step it records the bytes read, and, from a hook of its own on every
experts module, the experts the router picked (the union over the batch), so that the bytes a step
should read are known apart from what zerolite counted: per layer its dense part plus one extent per
routed expert. The prefill is left out of the per-step figures (a prompt's tokens route to nearly
every expert).

A step's bound, in the same run: the slower of
- the disk: a read-only pass of our engine (zerolite.layout.read_pass), cold, with no compute, over
  what that run's decode steps read (each layer's dense part and the experts its router picked, in
  step order; for whole layers, every layer whole as many times), per step;
- the compute: a decode step of the model's own modules with every weight in RAM and no reads, at
  the same batch, zerolite's thread settings: the model built with 5 decoder layers (random
  weights), each timed, its step made the whole model's by giving each of its layers the mean time
  of the small model's layers of its kind (dense, or of experts).
Scattered expert extents may read slower than whole layers in sequence (on virtual disks whose
host reads ahead, markedly so): the read pass prices that in.

With --pairs N, each batch size runs whole, routed, whole, ... (N routed runs, N + 1 whole ones),
and each routed run's speed-up is against the mean of the whole runs on either side of it: the
disk's speed drifts between runs (whole runs of one session: 1.09 to 1.48 tokens/s), and a single
pair puts that drift into the ratio. Each routed run has a read pass of its own after it, so each
run's step is set against its own bound. The bytes, routing and guesses are those of the first
routed run; every run's tokens are compared.

Printed: per batch size and mode, decode tokens/s (every run), the mean decode step against its
bound (the read pass per step, the compute in RAM; every run's ratio), the speed-up over whole
layers, the median decode step's bytes (of it experts), what the routing says it should read, the
ratio to dense + k/E of the experts, how many steps read exactly what the routing says, the guess
rate of the next-layer prefetch, the expert cache's hits (with --cpu-memory), and whether the tokens
equal the whole-layer run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import zerolite  # first: it sets torch's thread waits before torch loads (zerolite.openmp)

# isort: split
import torch
from rich.console import Console
from rich.table import Table

from models import convert_missing, make_model, write_checkpoint
from zerolite.generate.stats import StepClock
from zerolite.io.engine import IoEngine
from zerolite.layout.expert_parts import expert_read
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import BlockEntry, Piece
from zerolite.layout.read_pass import read_pass
from zerolite.moe.experts import find_experts
from zerolite.planner.machine import drop_page_cache


@dataclass(frozen=True)
class Shape:
    model_type: str
    config: dict
    folder: Path      # where --make-model builds it by default: source/, layout/, in-place/
    published: bool   # written as its checkpoint is published (per-expert tensors), not by save_pretrained


SHAPES = {
    "mixtral": Shape("mixtral", dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=10,
                                     num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                                     tie_word_embeddings=False),
                     Path("build/mixtral2g"), published=False),
    "deepseek-v3": Shape("deepseek_v3", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_hidden_layers=16, first_k_dense_replace=1, n_routed_experts=64,
                                             num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768,
                                             kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                             v_head_dim=128, vocab_size=32000, max_position_embeddings=4096,
                                             num_mtp_layers=0, tie_word_embeddings=False),
                         Path("build/dsv3"), published=True),
}
PROMPT_TOKENS = 16
IN_RAM_LAYERS = 5  # the in-RAM model's decoder layers (DeepSeek-V3's shape: its dense first and 4 of experts)


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
                           "early_unused": step.early_unused, "spared_bytes": step.spared_bytes,
                           "routed": [sorted(layer) for layer in self.routed]})
        for layer in self.routed:
            layer.clear()
        self._last = bytes_read, experts


def prompts(vocab: int, batch_size: int) -> torch.Tensor:
    return torch.randint(3, vocab, (batch_size, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))


def run_one(layout: str, experts: str, batch_size: int, new_tokens: int, cpu_memory: str) -> dict:
    """One configuration, in this (fresh) process: per decode step its time, bytes and routing."""
    with zerolite.load(layout, offload="nvme", cpu_memory=cpu_memory, device="cpu", experts=experts,
                       show_progress=False) as lm:
        manifest = lm.layout.manifest
        layers = lm.model.get_submodule(manifest.layers_path)
        routed: list[set[int]] = []  # per layer (empty for a dense one): the experts picked since the last step
        for layer in layers:
            union: set[int] = set()
            routed.append(union)
            found = find_experts(layer)
            if found is not None:
                layer.get_submodule(found.path).register_forward_pre_hook(  # before zerolite's, which may narrow them
                    lambda module, args, union=union: union.update(args[1].flatten().tolist()), prepend=True)
        ids = prompts(lm.model.config.vocab_size, batch_size)
        meter = StepMeter(lm, routed)
        before = lm.expert_counts()
        out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=meter)
        counts = lm.expert_counts().since(before)
        decode = meter.steps[1:]  # the first is the prefill
        step_s = [b - a for a, b in zip(meter.times[1:], meter.times[2:])]
        blocks = [manifest.block(name) for name in manifest.layer_names]
        dense = sum(b.dense_length for b in blocks)
        expert_total = sum(b.length for b in blocks) - dense

        def routed_bytes(step: dict, extra: int = 0, spared: int = 0) -> int:
            """What a step reads when it reads only the routed experts (and extra experts more, each
            as large as the first layer's, less spared bytes of theirs given up unread)."""
            areas = [b.experts for b in blocks]
            size = next(area.extent(0)[1] for area in areas if area)
            routed = sum(area.extent(e)[1] for area, layer in zip(areas, step["routed"]) if area for e in layer)
            return dense + extra * size - spared + routed

        area = next((b.experts for b in blocks if b.experts), None)
        return {
            "experts": experts, "batch_size": batch_size, "new_tokens": new_tokens,
            "tokens": out[:, PROMPT_TOKENS:].tolist(),
            "decode_tokens_per_s": meter.decode_tokens / meter.decode_s,
            "mean_step_s": meter.decode_s / meter.decode_steps,
            "step_s": [round(s, 4) for s in step_s],
            "bytes_per_step": [s["bytes"] for s in decode],
            "expert_bytes_per_step": [s["expert_bytes"] for s in decode],
            # what the routing says a step should read when it reads only the routed experts
            "routed_bytes_per_step": [routed_bytes(s) for s in decode] if area else None,
            # and with the guessed experts read early that the router then did not pick (what of
            # their reads had not started when it spoke given up)
            "routed_and_unused_bytes_per_step": [routed_bytes(s, s["early_unused"], s["spared_bytes"]) for s in decode]
            if area else None,
            "spared_bytes_per_step": [s["spared_bytes"] for s in decode],
            "routed_experts_per_step": [sum(map(len, s["routed"])) for s in decode],
            "routed": [s["routed"] for s in decode],  # per decode step, per layer: the experts picked
            "dense_bytes": dense, "expert_bytes": expert_total,
            "experts_per_layer": area.count if area else None,
            "experts_per_token": lm.model.config.num_experts_per_tok,
            "guessed": counts.guessed, "guessed_right": counts.guessed_right,
            "cache_hits": counts.cache_hits, "cache_lookups": counts.cache_lookups,
            "expert_cache_bytes": lm.plan.expert_cache,
        }


@torch.no_grad()
def run_in_ram(source: str, layers: int, batch_size: int, new_tokens: int) -> dict:
    """In this (fresh) process: the decode steps of source's model built with layers decoder layers,
    every weight in RAM (random), no reads, zerolite's thread settings (imported first). Each
    decoder layer is timed by hooks: the mean decode step, and of it each layer's mean seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    layer_s: list[list[float]] = []  # per forward, per layer
    for index, layer in enumerate(model.get_submodule("model.layers")):
        if index == 0:
            layer.register_forward_pre_hook(lambda module, args: layer_s.append([]))
        layer.register_forward_pre_hook(lambda module, args: setattr(module, "_began", time.perf_counter()))
        layer.register_forward_hook(lambda module, args, out: layer_s[-1].append(time.perf_counter() - module._began))
    ids = prompts(config.vocab_size, batch_size)
    clock = StepClock(lambda tokens: None)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
    decode = layer_s[1:]  # the first forward is the prefill
    return {"mean_step_s": clock.decode_s / clock.decode_steps,
            "layer_s": [statistics.mean(forward[i] for forward in decode) for i in range(layers)],
            "mixture": [find_experts(layer) is not None for layer in model.get_submodule("model.layers")]}


def compute_in_ram(args, batch_size: int) -> dict:
    """The compute of a decode step of the whole model at batch_size with every weight in RAM: the
    model built with IN_RAM_LAYERS decoder layers (a fresh process), its step with its layers' time
    replaced by the whole model's: each of its dense layers and each mixture layer as long as the
    small model's of that kind, on average."""
    run = child(args, "--in-ram", str(IN_RAM_LAYERS), "--batch-sizes", str(batch_size))
    manifest = Layout.open(args.layout).manifest
    mixture = [manifest.block(name).experts is not None for name in manifest.layer_names]
    kinds = {kind: statistics.mean(s for s, k in zip(run["layer_s"], run["mixture"]) if k == kind)
             for kind in set(run["mixture"])}
    rest_s = run["mean_step_s"] - sum(run["layer_s"])  # embeddings, head, sampling
    return {**run, "rest_s": rest_s, "step_s": rest_s + sum(kinds[kind] for kind in mixture)}


def read_only_pass(layout: Layout, steps: list[list[list[int]]] | None, count: int) -> float:
    """Seconds our engine takes to read, cold and with no compute, what count decode steps read:
    every layer whole, or (steps given) each layer's dense part and the experts its router picked,
    in the order a step reads them. The disk's share of each mode's bound."""
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
            if block.experts is None:
                parts[block.name] = block
                names.append(block.name)
                continue
            dense = f"{block.name}.dense"
            parts[dense] = part_of(block, dense, 0, block.dense_length, block.experts.dense_crc32)
            names.append(dense)
            for expert in experts:
                name = f"{block.name}.expert{expert}"
                if block.experts.sources is None:
                    start, length = block.experts.extent(expert)
                    parts[name] = part_of(block, name, start, length, block.experts.crc32s[expert])
                else:
                    parts[name] = expert_in_place(block, name, expert)
                names.append(name)
    return Layout(layout.folder, replace(layout.manifest, blocks=tuple(parts.values()))), names


def part_of(block: BlockEntry, name: str, start: int, length: int, crc32: int | None) -> BlockEntry:
    """Bytes [start, start + length) of block as a block of its own: a stretch of the layout's data
    file, or (in place) the stretches of the pieces of shards they lie in."""
    if not block.pieces:
        return BlockEntry(name, block.offset + start, length, crc32, ())
    pieces, at = [], 0
    for piece in block.pieces:
        low, high = max(start, at), min(start + length, at + piece.length)
        if low < high:
            pieces.append(Piece(piece.shard, piece.offset + low - at, high - low))
        at += piece.length
    return BlockEntry(name, 0, length, None, (), pieces=tuple(pieces))


def expert_in_place(block: BlockEntry, name: str, expert: int) -> BlockEntry:
    """One expert of a mixture's layer in place as a block of its own: the pages of the shards the
    runtime reads for it (zerolite.layout.expert_parts), without the copies from scratch into place."""
    plan = expert_read(block.experts.sources, expert, block.experts.stride, direct=True)
    pieces = [Piece(shard, offset, length) for shard, offset, length, _ in plan.direct]
    pieces += [Piece(shard, offset, length) for shard, offset, length in plan.reads]
    return BlockEntry(name, 0, sum(p.length for p in pieces), None, (), pieces=tuple(pieces))


def child(args, *how: str) -> dict:
    """One run, in a fresh process, after the page cache is dropped: its JSON line."""
    if not drop_page_cache():
        sys.exit("bench_moe: run as root: the page cache must be dropped before each run")
    done = subprocess.run([sys.executable, __file__, *how, "--source", str(args.source), "--layout", str(args.layout),
                           "--new-tokens", str(args.new_tokens), "--cpu-memory", args.cpu_memory],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"bench_moe: the run {' '.join(how)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured(args, experts: str, batch_size: int) -> dict:
    return child(args, "--run", experts, "--batch-sizes", str(batch_size))


def prepare(args, shape: Shape) -> None:
    """With --make-model, the model (and, unless --in-place, its layout) where missing; with
    --in-place, the checkpoint's shards planned in place into --layout."""
    if args.make_model and shape.published and not (args.source / "config.json").is_file():
        write_checkpoint(args.source, shape.model_type, shape.config)
    elif args.make_model and not shape.published:
        make_model(args.source, shape.model_type, shape.config, {})
    if args.in_place:
        from zerolite.convert.in_place import NotInPlace
        from zerolite.convert.resolve import in_place

        try:
            in_place(str(args.source), args.layout, None, False)
        except NotInPlace as e:
            sys.exit(f"bench_moe: {args.source} cannot stream in place: {e}")
    elif args.make_model:
        convert_missing(args.source, {args.layout: {}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    parser.add_argument("--source", "--model", type=Path, help="The model folder (default: the shape's source/).")
    parser.add_argument("--layout", type=Path, help="Its layout (default: the shape's layout/, or in-place/).")
    parser.add_argument("--make-model", action="store_true")
    parser.add_argument("--in-place", action="store_true", help="Stream the checkpoint's own safetensors shards.")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=1, help="Routed runs per batch size, each between two whole runs.")
    parser.add_argument("--cpu-memory", default="0", help="The runs' host budget (an expert cache once no layer fits).")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--run", choices=["routed", "whole"], help=argparse.SUPPRESS)  # one run, in a fresh process
    parser.add_argument("--in-ram", type=int, help=argparse.SUPPRESS)  # one in-RAM compute run, of so many layers
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    args.source = args.source or shape.folder / "source"
    args.layout = args.layout or shape.folder / ("in-place" if args.in_place else "layout")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.run:
        print(json.dumps(run_one(str(args.layout), args.run, sizes[0], args.new_tokens, args.cpu_memory)))
        return
    if args.in_ram:
        print(json.dumps(run_in_ram(str(args.source), args.in_ram, sizes[0], args.new_tokens)))
        return
    prepare(args, shape)
    layout = Layout.open(args.layout)

    results = []
    for batch_size in sizes:
        compute = compute_in_ram(args, batch_size)
        # Routed runs between whole ones (whole, routed, whole, ...): each routed run is set against
        # the mean of the whole runs beside it, since this disk's speed drifts from run to run. Each
        # routed run's read pass follows it.
        wholes, routeds = [measured(args, "whole", batch_size)], []
        for _ in range(args.pairs):
            routeds.append(measured(args, "routed", batch_size))
            steps = len(routeds[-1]["routed"])
            routeds[-1]["read_pass_step_s"] = read_only_pass(layout, routeds[-1]["routed"], steps) / steps
            if args.pairs > 1:
                wholes.append(measured(args, "whole", batch_size))
        whole, routed = wholes[0], routeds[0]
        results += [whole, routed]
        steps = len(whole["routed"])
        whole["read_pass_step_s"] = read_only_pass(layout, None, steps) / steps
        for r, runs in ((whole, wholes), (routed, routeds)):
            r["decode_tokens_per_s_runs"] = [run["decode_tokens_per_s"] for run in runs]
            r["mean_step_s_runs"] = [run["mean_step_s"] for run in runs]
            r["compute_in_ram"] = compute
            # each run against its own read pass (the whole runs against the one whole read pass)
            r["read_pass_step_s_runs"] = [run.get("read_pass_step_s", whole["read_pass_step_s"]) for run in runs]
            r["bound_s_runs"] = [max(reads, compute["step_s"]) for reads in r["read_pass_step_s_runs"]]
            r["step_over_bound_runs"] = [s / b for s, b in zip(r["mean_step_s_runs"], r["bound_s_runs"])]
            r["step_over_bound"] = statistics.median(r["step_over_bound_runs"])
        routed["speedups"] = [run["decode_tokens_per_s"]
                              / statistics.mean(w["decode_tokens_per_s"] for w in wholes[i:i + 2])
                              for i, run in enumerate(routeds)]
        routed["speedup"] = statistics.median(routed["speedups"])
        routed["same_tokens_as_whole"] = all(run["tokens"] == whole["tokens"] for run in routeds + wholes)
        if routed["experts_per_layer"]:
            share = routed["experts_per_token"] / routed["experts_per_layer"]  # top-k of E
            routed["top_k_bound_bytes"] = routed["dense_bytes"] + share * routed["expert_bytes"]
            routed["bytes_over_top_k_bound"] = (statistics.median(routed["bytes_per_step"])
                                                / routed["top_k_bound_bytes"])
            routed["bytes_equal_routing"] = sum(a == b for a, b in zip(routed["bytes_per_step"],
                                                                       routed["routed_bytes_per_step"]))
            routed["bytes_equal_routing_and_unused"] = sum(
                a == b for a, b in zip(routed["bytes_per_step"], routed["routed_and_unused_bytes_per_step"]))

    print_table(args, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def print_table(args, results: list[dict]) -> None:
    table = Table(title=f"{args.layout}: streamed from disk at every step, "
                        f"decode steps of {args.new_tokens} new tokens")
    k = results[0]["experts_per_token"]
    for column in ["batch", "experts", "tokens/s", "speed-up", "step s", "read pass s/step", "compute s/step",
                   "step / bound", "GB/step (median)", "of it experts", "routing says", f"/ dense + k/E (k={k})",
                   "steps = routing (+ early unused)", "guesses right", "cache hits", "tokens = whole"]:
        table.add_column(column, justify="right")
    for r in results:
        routed = r["experts"] == "routed" and "bytes_over_top_k_bound" in r

        def runs(values, form="{:.2f}"):
            return " ".join(form.format(v) for v in values)

        table.add_row(
            str(r["batch_size"]), r["experts"], runs(r["decode_tokens_per_s_runs"]),
            (f"{r['speedup']:.2f}x" + (f" ({runs(r['speedups'])})" if len(r["speedups"]) > 1 else ""))
            if "speedup" in r else "1.00x",
            runs(r["mean_step_s_runs"], "{:.3f}"),
            runs(r["read_pass_step_s_runs"] if r["experts"] == "routed" else r["read_pass_step_s_runs"][:1], "{:.3f}"),
            f"{r['compute_in_ram']['step_s']:.3f}",
            f"{r['step_over_bound']:.2f}x ({runs(r['step_over_bound_runs'])})",
            f"{statistics.median(r['bytes_per_step']) / 1e9:.3f}",
            f"{statistics.median(r['expert_bytes_per_step']) / 1e9:.3f}" if routed else "-",
            f"{statistics.median(r['routed_bytes_per_step']) / 1e9:.3f}" if routed else "-",
            f"{r['bytes_over_top_k_bound']:.3f}" if routed else "-",
            f"{r['bytes_equal_routing']} ({r['bytes_equal_routing_and_unused']})/{len(r['bytes_per_step'])}"
            if routed else "-",
            f"{r['guessed_right']}/{r['guessed']}" if routed and r["guessed"] else "-",
            f"{r['cache_hits']}/{r['cache_lookups']} ({r['expert_cache_bytes'] / 1e9:.2f} GB)"
            if r["cache_lookups"] else "-",
            str(r["same_tokens_as_whole"]) if "same_tokens_as_whole" in r else "-",
        )
    Console(width=250).print(table)


if __name__ == "__main__":
    main()
