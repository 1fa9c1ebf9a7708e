"""What zerolite's weight schemes cost in quality: the perplexity of the built-in SmolLM2-135M-Instruct
over the first 4096 tokens of pydoc's topic documentation (tools/perplexity.py), for the layout's
dtype (the base) and each scheme of --weights.

    python tools/quality.py [--weights int8,int4-g32,int4-g64,int4-g128] [--tokens 4096] [--reference]
                            [--path ROOT] [--json FILE] [--model MODEL] [--dtype bf16|fp16|fp32]
                            [--kv-bits 16,8,4] [--kv-chunk 64] [--kv-offload SHARE] [--kv-disk SHARE]
                            [--kv-attention device|cpu]

Each variant is a layout converted from MODEL (default: the built-in GGUF) into ROOT/VARIANT-DTYPE
(ROOT defaults to zerolite's cache dir/quality) and reused on later runs: the base with no weights
argument, int8 with weights="int8", int4-gNN with weights="int4", group_size=NN (SmolLM2's 576
columns at group 128 end in a partial group, which convert pads). A variant that convert refuses
for this model is reported with convert's reason, never run some other way. Each layout
is loaded with offload="cpu" on the CPU and scored by the model's own forward.

The text fits SmolLM2's 8192 positions in one window; a model with fewer positions is scored in
windows of its context, every half window (tools/perplexity.py). The compute runs in the layout's
dtype, as zerolite binds the layout's bytes: fp32 for the built-in model (its GGUF dequantizes to
fp32 exactly), bf16 or fp16 for layouts converted with --dtype; a quantized variant's activations
stay in that dtype and its matmuls run as zerolite's quantized layers run them. The loss is taken
in fp32 in every case. --reference scores the same ids with transformers alone on MODEL, in the
base layout's dtype: the base figure should agree with it.

--kv-bits 16,8,4 scores the base layout again with its K/V cache at each of those bits (zerolite's
--kv-bits), the text fed --kv-chunk tokens at a time through the cache (tools/perplexity.py's
perplexity_through_cache), so that every prediction attends to the K/V of the tokens before it as
the cache holds them: at 8 and 4 bits quantized when appended, dequantised when read, as decoding
reads them. Each value, and each key at 8 bits, is quantized alone; 4-bit keys are stored per
channel in groups of zerolite.memory_model.KV_KEY_TOKENS tokens (128), waiting at 8 bits until their
group fills, and a chunk reads the keys of the group it fills as they waited: with a chunk that
divides the group (64 does), the chunks aligned with the groups, every prediction reads the K/V as
token-by-token decoding does. This is decoding's perplexity. Each is compared with the 16-bit cache's.
--kv-offload, --kv-disk and --kv-attention put those shares of the layers' K/V in host memory, on disk
(the weights then streamed from the layout: the K/V files go under its folder) and attended on the
CPU, as generate's flags do: every tier keeps the K/V as the device does, so the figures are the same.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM

import zerolite
from perplexity import Score, context_window, corpus_ids, perplexity, perplexity_through_cache
from zerolite.convert.paths import builtin_gguf, cache_dir
from zerolite.convert.writer import convert
from zerolite.errors import ZeroliteError
from zerolite.hf import load_tokenizer, quiet_transformers
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES
from zerolite.progress import token_progress

DEFAULT_WEIGHTS = "int8,int4-g32,int4-g64,int4-g128"
UNAVAILABLE = "cannot be converted"


@dataclass(frozen=True)
class Variant:
    name: str
    convert_args: dict = field(default_factory=dict)


def parse_variants(weights: str) -> list[Variant]:
    """The base, then one variant per scheme named in the comma list."""
    variants = [Variant("base")]
    for name in filter(None, (part.strip() for part in weights.split(","))):
        group = re.fullmatch(r"int4-g(\d+)", name)
        if name == "int8":
            variants.append(Variant(name, {"weights": "int8"}))
        elif group:
            variants.append(Variant(name, {"weights": "int4", "group_size": int(group[1])}))
        else:
            raise argparse.ArgumentTypeError(f"unknown weight scheme {name!r}: "
                                             "use int8 or int4-gNN (int4-g32, int4-g64, ...)")
    return variants


def convert_variant(variant: Variant, model: str, root: Path, dtype: str | None) -> Path | str:
    """The variant's layout folder, converted if need be; or, for a scheme this build's convert
    does not take, the reason why not."""
    folder = root / f"{variant.name}-{dtype or 'auto'}"
    try:
        # Binding first: a TypeError raised inside convert would be a bug, not a missing scheme.
        inspect.signature(convert).bind(model, folder, dtype=dtype, **variant.convert_args)
    except TypeError:
        return f"this build's convert takes no {'/'.join(variant.convert_args)} argument"
    try:
        convert(model, folder, dtype=dtype, **variant.convert_args)
    except ZeroliteError as e:  # a convert that knows the keyword but not this scheme (int4 before it lands)
        if not variant.convert_args:
            raise  # the base must convert: without it there is nothing to compare with
        return str(e)
    return folder


def score_layout(folder: Path, ids, label: str) -> tuple[Score, float]:
    """The layout's score, every layer held in host memory, and the seconds the scoring took."""
    with zerolite.load(folder, offload="cpu", device="cpu", show_progress=False) as lm:
        return timed_score(lm.model, ids, label)


def score_kv_bits(folder: Path, ids, bits: list[int], chunk: int, tiers: dict | None = None) -> list[dict]:
    """The base layout scored through its K/V cache at each of bits, the first the baseline; tiers:
    zerolite.load's kv_offload, kv_disk and kv_attention, where the K/V lives and is attended."""
    tiers = tiers or {}
    offload = "nvme" if tiers.get("kv_disk") else "cpu"  # K/V files go under the offload root
    rows = []
    for each in bits:
        with zerolite.load(folder, offload=offload, device="cpu", kv_bits=each, show_progress=False, **tiers) as lm:
            started = time.perf_counter()
            with token_progress(f"K/V at {each} bits", len(ids) - 1) as progress:
                score = perplexity_through_cache(lm.model, ids, lm.new_cache, chunk, progress=progress)
        rows.append({"kv_bits": each, "mean_nll": score.mean_nll, "perplexity": score.perplexity,
                     "score_s": time.perf_counter() - started})
    for row in rows:
        row["change_pct"] = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1)
    return rows


def parse_kv_bits(text: str) -> list[int]:
    try:
        bits = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kv-bits {text!r}: give a comma list of 16, 8 and 4") from None
    if not bits or any(each not in (16, 8, 4) for each in bits):
        raise argparse.ArgumentTypeError(f"--kv-bits {text!r}: give a comma list of 16, 8 and 4")
    return bits


def score_reference(model: str, ids, dtype: str) -> tuple[Score, float]:
    """The same score with transformers alone, on MODEL as transformers reads it."""
    source = Path(model)
    location = dict(pretrained_model_name_or_path=source.parent, gguf_file=source.name) if source.suffix == ".gguf" \
        else dict(pretrained_model_name_or_path=model)
    reference = AutoModelForCausalLM.from_pretrained(**location, dtype=DTYPES[dtype]).eval()
    return timed_score(reference, ids, "transformers")


def timed_score(model, ids, label: str) -> tuple[Score, float]:
    started = time.perf_counter()
    with token_progress(label, len(ids) - 1) as progress:
        score = perplexity(model, ids, progress=progress)
    return score, time.perf_counter() - started


def score_variants(variants: list[Variant], base_folder: Path, model: str, root: Path,
                   dtype: str | None, ids) -> list[dict]:
    rows = []
    for variant in variants:
        folder = base_folder if variant.name == "base" else convert_variant(variant, model, root, dtype)
        if isinstance(folder, str):
            rows.append({"variant": variant.name, "available": False, "reason": folder})
            continue
        manifest = Layout.open(folder).manifest
        score, score_s = score_layout(folder, ids, variant.name)
        rows.append({"variant": variant.name, "available": True, "layout": str(folder),
                     "layer_bytes": manifest.nbytes(manifest.layer_names), "mean_nll": score.mean_nll,
                     "perplexity": score.perplexity, "score_s": score_s})
    return rows


def report(console: Console, rows: list[dict]) -> None:
    table = Table(title="tools/quality: perplexity over pydoc_data.topics")
    for column in ("variant", "decoder layers", "perplexity", "vs base", "scored in"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in rows:
        layers = f"{row['layer_bytes']:,} B" if "layer_bytes" in row else "-"
        if row["available"]:
            table.add_row(row["variant"], layers, f"{row['perplexity']:.3f}", f"{row['change_pct']:+.2f}%",
                          f"{row['score_s']:.1f} s")
        else:
            table.add_row(row["variant"], layers, UNAVAILABLE, "-", "-")
    console.print(table)
    for row in rows:
        if not row["available"]:
            console.print(f"{row['variant']}: {UNAVAILABLE}: {row['reason']}", highlight=False)


def report_kv_bits(console: Console, rows: list[dict], chunk: int, tiers: dict) -> None:
    where = ", ".join(f"{name} {value}" for name, value in tiers.items()) or "on the device"
    table = Table(title=f"tools/quality: the base's K/V cache at each bits ({where}), "
                  f"the text fed {chunk} tokens at a time")
    for column in ("K/V bits", "perplexity", f"vs {rows[0]['kv_bits']} bits", "scored in"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["kv_bits"]), f"{row['perplexity']:.3f}", f"{row['change_pct']:+.2f}%",
                      f"{row['score_s']:.1f} s")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=parse_variants, default=parse_variants(DEFAULT_WEIGHTS),
                        help="weight schemes beside the base, a comma list "
                        f"(default {DEFAULT_WEIGHTS}; '' for the base alone)")
    parser.add_argument("--tokens", type=int, default=4096, help="how many tokens of the text to score")
    parser.add_argument("--reference", action="store_true", help="score the base with transformers alone too")
    parser.add_argument("--path", type=Path, default=None,
                        help="where the variants' layouts go (default: zerolite's cache dir/quality)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("--model", default=None,
                        help="what to convert (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                        help="the layouts' dtype (default: the model's)")
    parser.add_argument("--kv-bits", type=parse_kv_bits, default=None,
                        help="score the base through its K/V cache at each of these bits too, a comma list "
                        "(16,8,4: the first is the baseline)")
    parser.add_argument("--kv-chunk", type=int, default=64,
                        help="tokens fed through the cache at a time (a divisor of the 4-bit keys' group of 128 "
                        "tokens reads the K/V as decoding does)")
    parser.add_argument("--kv-offload", type=float, default=0.0, metavar="SHARE",
                        help="with --kv-bits: that share of the layers' K/V in host memory")
    parser.add_argument("--kv-disk", type=float, default=0.0, metavar="SHARE",
                        help="with --kv-bits: that share of the layers' K/V on disk")
    parser.add_argument("--kv-attention", choices=("device", "cpu"), default="device",
                        help="with --kv-bits: where the layers with K/V in host memory are attended")
    args = parser.parse_args()
    quiet_transformers()
    console = Console(width=None if sys.stdout.isatty() else 160)  # the table stays whole in a log
    model = args.model or str(builtin_gguf())
    root = args.path or cache_dir() / "quality"

    try:
        base_folder = convert_variant(args.weights[0], model, root, args.dtype)
    except ZeroliteError as e:
        sys.exit(f"quality: error: {e}")
    tokenizer = load_tokenizer(base_folder)
    if tokenizer is None:
        sys.exit(f"quality: error: {model} has no tokenizer to read the text with")
    ids = corpus_ids(tokenizer, args.tokens)
    dtype = Layout.open(base_folder).manifest.dtype
    window = context_window(AutoConfig.from_pretrained(base_folder)) or args.tokens
    console.print(f"{Path(model).name}: {args.tokens} tokens of pydoc_data.topics "
                  f"(Python {platform.python_version()}), "
                  f"{'one window' if args.tokens <= window else f'windows of {window} tokens'}, computed in {dtype}",
                  highlight=False)

    rows = score_variants(args.weights, base_folder, model, root, args.dtype, ids)
    if args.reference:
        score, score_s = score_reference(model, ids, dtype)
        rows.append({"variant": "transformers (reference)", "available": True, "mean_nll": score.mean_nll,
                     "perplexity": score.perplexity, "score_s": score_s})
    for row in rows:
        if row["available"]:
            row["change_pct"] = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1)

    report(console, rows)
    tiers = {name: value for name, value in (("kv_offload", args.kv_offload), ("kv_disk", args.kv_disk)) if value}
    if args.kv_attention != "device":
        tiers["kv_attention"] = args.kv_attention
    try:
        kv_rows = score_kv_bits(base_folder, ids, args.kv_bits, args.kv_chunk, tiers) if args.kv_bits else []
    except ZeroliteError as e:  # tiers zerolite.load refuses
        sys.exit(f"quality: error: {e}")
    if kv_rows:
        report_kv_bits(console, kv_rows, args.kv_chunk, tiers)
    if args.json:
        figures = {"model": model, "python": platform.python_version(),
                   "text": "pydoc_data.topics, sorted keys, joined by a blank line", "tokens": args.tokens,
                   "window": window, "dtype": dtype, "ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
                   "variants": rows, "kv_bits": kv_rows, "kv_chunk": args.kv_chunk, "kv_tiers": tiers}
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
