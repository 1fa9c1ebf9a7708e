"""Continuous batching against batch after batch: one input file of prompts whose new-token counts
spread from 8 to 256 (each line's own max_new_tokens), through `zerolite generate`'s two
batchings at the same batch size on the same loaded model, greedy.

    python tools/bench_batching.py [--prompts 64] [--batch-size 8] [--offload cpu] [--rounds 1] [--json out.json]

The model is a small random Llama (tools/models.py, built once under build/batching/) in a layout
of --dtype fp32 (by default: in bf16 the sums of a batch of another shape round differently, and a
random model's nearly equal logits then tip greedy decoding to other tokens, in either batching),
its layers streamed from host memory (--offload cpu) or from disk (--offload nvme, every layer read
per step). Prints each
batching's new tokens, wall time (prefill included), tokens/s and forwards, their ratio, and
whether every id's completion is the same in both files. With --rounds N the two take turns N
times (static first) and the medians are compared: on a shared machine the load drifts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import make_model  # noqa: E402

# about 60M parameters: a step's weights (120 MB) outweigh eight rows' arithmetic on a small CPU
MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=True)
BUILD = Path("build/batching")


def prompts_file(path: Path, prompts: int, shortest: int, longest: int, seed: int) -> list[int]:
    """prompts lines of random token ids (8 to 64 of them), their max_new_tokens evenly spread
    over shortest..longest in a shuffled order; returns those counts."""
    rng = random.Random(seed)
    counts = [shortest + round(k * (longest - shortest) / max(prompts - 1, 1)) for k in range(prompts)]
    rng.shuffle(counts)
    with path.open("w") as f:
        for i, count in enumerate(counts):
            ids = [rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(rng.randrange(8, 65))]
            f.write(json.dumps({"id": f"q{i}", "input_ids": ids, "max_new_tokens": count}) + "\n")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shortest", type=int, default=8, help="the fewest new tokens a line asks for")
    parser.add_argument("--longest", type=int, default=256, help="the most new tokens a line asks for")
    parser.add_argument("--offload", choices=("cpu", "nvme"), default="cpu",
                        help="cpu: the layers streamed from host memory; nvme: every layer read from disk per step")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the layout's")
    parser.add_argument("--build", type=Path, default=BUILD, help="where the model, its layout and the files go")
    parser.add_argument("--rounds", type=int, default=1, help="each batching this many times, taking turns")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()

    import zerolite
    from zerolite.generate.job import generate_file
    from zerolite.sampling import Sampling

    source, layout = args.build / "source", args.build / f"layout-{args.dtype}"
    make_model(source, "llama", MODEL_CONFIG, {layout: {"dtype": args.dtype}})
    prompts = args.build / "prompts.jsonl"
    counts = prompts_file(prompts, args.prompts, args.shortest, args.longest, seed=1)
    memory = {"cpu_memory": 0} if args.offload == "nvme" else {}
    report = {"prompts": args.prompts, "batch_size": args.batch_size, "offload": args.offload, "dtype": args.dtype,
              "asked_new_tokens": sum(counts), "model": MODEL_CONFIG}
    runs = {"static": [], "continuous": []}
    with zerolite.load(str(layout), offload=args.offload, device="cpu", show_progress=False, **memory) as lm:
        for _ in range(args.rounds):
            for batching in runs:
                output = args.build / f"out-{batching}.jsonl"
                output.unlink(missing_ok=True)
                started, cpu_started = time.perf_counter(), time.process_time()
                stats = generate_file(lm, prompts, output, Sampling(max_new_tokens=args.longest),
                                      batch_size=args.batch_size, show_progress=False, batching=batching)
                seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
                runs[batching].append({"new_tokens": stats.new_tokens, "seconds": round(seconds, 3),
                                       "tokens_per_s": round(stats.new_tokens / seconds, 2), "cpu_s": round(cpu_s, 3),
                                       "forwards": stats.forwards})
                # CPU seconds beside the wall's: on a machine others share, they move less with the load
                print(f"{batching:>10}: {stats.new_tokens} new tokens in {seconds:.1f} s ({cpu_s:.1f} CPU s): "
                      f"{stats.new_tokens / seconds:.1f} tokens/s, {stats.forwards} forwards", flush=True)
    for batching, done in runs.items():
        report[batching] = {"runs": done, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in done),
                            "cpu_s": statistics.median(r["cpu_s"] for r in done),
                            "forwards": statistics.median(r["forwards"] for r in done)}
    lines = {b: {r["id"]: r for r in map(json.loads, (args.build / f"out-{b}.jsonl").read_text().splitlines())}
             for b in ("static", "continuous")}
    report["same_outputs_per_id"] = lines["static"] == lines["continuous"] and len(lines["static"]) == args.prompts
    report["same_line_order"] = list(lines["static"]) == list(lines["continuous"])
    report["speedup"] = round(report["continuous"]["tokens_per_s"] / report["static"]["tokens_per_s"], 3)
    report["cpu_speedup"] = round(report["static"]["cpu_s"] / report["continuous"]["cpu_s"], 3)
    report["forwards_ratio"] = round(report["static"]["forwards"] / report["continuous"]["forwards"], 3)
    print(f"continuous / static: {report['speedup']:.2f}x tokens/s ({report['cpu_speedup']:.2f}x in CPU time, "
          f"{report['forwards_ratio']:.2f}x fewer forwards); same outputs per id: "
          f"{report['same_outputs_per_id']}, same line order: {report['same_line_order']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if not report["same_outputs_per_id"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
