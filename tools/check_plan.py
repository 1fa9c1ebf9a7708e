"""zerolite plan's predictions beside measured runs on this machine, and its choice beside hand-set policies.
Run as root (the page cache is dropped before each run).

    python tools/check_plan.py --dense LAYOUT --int4 LAYOUT --moe LAYOUT [--new-tokens 16] [--prompt-tokens 16]
        [--json out.json] [--markdown out.md]

1. The disk's rate, recorded for plan: the engine's cold read of the dense layout (zerolite profile --disk).
2. The grid: each model x {every layer streamed (--cpu-memory 0), half the layers in host memory} x
   batch {1, 16} (the prefetch depth, not given, is plan's in both the plan and the run). For each,
   `zerolite plan --json` and `zerolite generate` take the same flags; the table sets the predicted
   decode step beside the measured one (generate's decode seconds over its decode steps).
3. For each model and batch, plan's own choice (the tiers and prefetch depth searched, for this job:
   as many prompts as the batch) run the same way; its job time (loading, prefill and decode, from
   generate's stats) beside the best hand-set policy's.
Each run is a fresh process; the three policies of a model and batch run in turns, --rounds times,
and their medians are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zerolite.io.engine import host_bytes
from zerolite.layout.folder import Layout
from zerolite.planner.machine import drop_page_cache

ZEROLITE = [sys.executable, "-m", "zerolite"]
TOLERANCE = 0.20      # the bound on a predicted decode step
CHOICE_FLOOR = 0.9    # the chosen policy against the best hand-set one


def half_the_layers(layout: Path) -> int:
    """A --cpu-memory holding half the layers, each counted at the host memory it takes (Plan.make)."""
    manifest = Layout.open(layout).manifest
    widest = max(manifest.block(name).length for name in manifest.layer_names)
    return host_bytes(widest) * (len(manifest.layer_names) // 2)


def plan(layout: Path, flags: list[str], args) -> dict:
    out = subprocess.run([*ZEROLITE, "plan", "--model", str(layout), "--json", "--prompt-tokens",
                          str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), *flags], capture_output=True,
                          text=True, check=True)
    return json.loads(out.stdout)


def run(layout: Path, flags: list[str], batch: int, args, scratch: Path) -> dict:
    prompts = scratch / f"prompts-{batch}.jsonl"
    rng = random.Random(0)
    rows = [{"id": str(i), "input_ids": [rng.randrange(100, 30000) for _ in range(args.prompt_tokens)]}
            for i in range(batch)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stats = scratch / "stats.json"
    drop_page_cache()
    subprocess.run([*ZEROLITE, "generate", "--model", str(layout), "--input", str(prompts), "--output",
                    str(scratch / "out.jsonl"), "--max-new-tokens", str(args.new_tokens), "--stats-json", str(stats),
                    "--device", "cpu", *flags],
                   check=True, capture_output=True, text=True)
    (scratch / "out.jsonl").unlink()
    s = json.loads(stats.read_text())
    return {"decode_step_s": s["decode_s"] / max(s["decode_steps"], 1),
            "job_s": s["load_s"] + s["prefill_s"] + s["decode_s"], "load_s": s["load_s"], "prefill_s": s["prefill_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", type=Path, required=True, help="a bf16 layout")
    parser.add_argument("--int4", type=Path, required=True, help="the same model converted with --weights int4")
    parser.add_argument("--moe", type=Path, required=True, help="a mixture-of-experts layout")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each policy, in turns; medians are reported")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 160)

    subprocess.run([*ZEROLITE, "profile", "--disk", str(args.dense)], check=True)
    models = {"dense bf16": args.dense, "dense int4": args.int4, "MoE bf16": args.moe}
    cases, choices = [], []
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        for model, layout in models.items():
            tiers = {"all streamed": "0", "half in host": f"{half_the_layers(layout)}B"}
            for batch in args.batch_sizes:
                policies = {tier: ["--batch-size", str(batch), "--cpu-memory", budget]
                            for tier, budget in tiers.items()}
                predicted = {tier: plan(layout, flags, args) for tier, flags in policies.items()}
                chosen = plan(layout, ["--batch-size", str(batch)], args)
                policies["chosen"] = chosen["command"][chosen["command"].index("--batch-size"):]
                runs = {name: [] for name in policies}
                for _ in range(args.rounds):  # in turns, so that a drifting disk treats each alike
                    for name, flags in policies.items():
                        runs[name].append(run(layout, flags, batch, args, scratch))
                measured = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                            for name, rs in runs.items()}
                for tier in tiers:
                    error = predicted[tier]["decode_step_s"] / measured[tier]["decode_step_s"] - 1
                    cases.append({"model": model, "tiers": tier, "batch": batch, "predicted": predicted[tier],
                                  "measured": measured[tier], "error": error})
                    console.print(f"{model}, {tier}, batch {batch}: "
                                  f"predicted {predicted[tier]['decode_step_s']:.3f} s, "
                                  f"measured {measured[tier]['decode_step_s']:.3f} s ({error:+.0%})", highlight=False)
                best = min(tiers, key=lambda tier: measured[tier]["job_s"])
                choices.append({"model": model, "batch": batch, "flags": policies["chosen"], "predicted": chosen,
                                "measured": measured["chosen"], "best_hand_set": best,
                                "best_job_s": measured[best]["job_s"],
                                "ratio": measured[best]["job_s"] / measured["chosen"]["job_s"]})
                console.print(f"{model}, batch {batch}: plan chose {' '.join(policies['chosen'])}: job "
                              f"{measured['chosen']['job_s']:.2f} s against {measured[best]['job_s']:.2f} s ({best}): "
                              f"{choices[-1]['ratio']:.2f}x", highlight=False)

    table = Table(title="zerolite plan: predicted decode step against measured")
    for column in ("model", "layers", "batch", "bottleneck", "predicted s", "measured s", "error"):
        table.add_column(column, justify="right" if column not in ("model", "layers", "bottleneck") else "left")
    for c in cases:
        table.add_row(c["model"], c["tiers"], str(c["batch"]), c["predicted"]["bottleneck"],
                      f"{c['predicted']['decode_step_s']:.3f}", f"{c['measured']['decode_step_s']:.3f}",
                      f"{c['error']:+.0%}", style=None if abs(c["error"]) <= TOLERANCE else "red")
    console.print(table)
    choice_table = Table(title="plan's choice against the hand-set policies (job: loading, prefill, decode)")
    for column in ("model", "batch", "chosen flags", "its job s", "best hand-set", "its job s", "ratio"):
        choice_table.add_column(column)
    for c in choices:
        choice_table.add_row(c["model"], str(c["batch"]), " ".join(c["flags"]), f"{c['measured']['job_s']:.2f}",
                             c["best_hand_set"], f"{c['best_job_s']:.2f}", f"{c['ratio']:.2f}",
                             style=None if c["ratio"] >= CHOICE_FLOOR else "red")
    console.print(choice_table)
    within = sum(abs(c["error"]) <= TOLERANCE for c in cases)
    console.print(f"{within} of {len(cases)} predictions within {TOLERANCE:.0%}; "
                  f"{sum(c['ratio'] >= CHOICE_FLOOR for c in choices)} of {len(choices)} choices "
                  f"at {CHOICE_FLOOR}x the best or better")
    if args.json:
        args.json.write_text(json.dumps({"cases": cases, "choices": choices}, indent=2) + "\n")
    if args.markdown:
        lines = ["| model | layers | batch | bottleneck | predicted s | measured s | error |",
                 "|---|---|---:|---|---:|---:|---:|"]
        lines += [f"| {c['model']} | {c['tiers']} | {c['batch']} | {c['predicted']['bottleneck']} | "
                  f"{c['predicted']['decode_step_s']:.3f} | {c['measured']['decode_step_s']:.3f} | "
                  f"{c['error']:+.0%} |" for c in cases]
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
