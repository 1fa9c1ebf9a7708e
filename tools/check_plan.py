"""zerolite plan's predictions beside measured runs on this machine, and its choice beside hand-set policies.
Run as root (the page cache is dropped before each run).

    python tools/check_plan.py --dense LAYOUT --int4 LAYOUT --moe LAYOUT [--new-tokens 16] [--prompt-tokens 16]
        [--groups tiers kv-bits mixed ...] [--json out.json] [--markdown out.md]

1. The disk's rate, recorded for plan: the engine's cold read of the dense layout (zerolite profile --disk).
2. Groups of runs, each a model, a batch and flags pinned alike in the plan and the run:
   tiers      each model x batch {1, 16}, nothing else pinned
   kv-bits    the dense model's K/V at 16, 8 and 4 bits (--kv-bits), --kv-prompt-tokens long prompts, so
              that reading, dequantising and quantizing the K/V weigh in each step
   mixed      an input file of 4 x batch prompts asking from an eighth of twice --new-tokens to all of it
              (each line's own max_new_tokens), run by continuous batching; plan is given their mean (at
              4 x --new-tokens, jobs of 84 to 201 s: seven minutes a round)
   kv-disk, micro-batches, cpu-attention   K/V half on disk (--kv-disk 0.5), the batch in 4 micro-batches
              (--micro-batches 4), attention over K/V in host memory on the CPU (--kv-offload 1
              --kv-attention cpu, with --device cuda); each runs where generate takes its flag
   Within a group, each of {every layer streamed (--cpu-memory 0), half the layers in host memory} (the
   prefetch depth, not given, is plan's in both the plan and the run): `zerolite plan --json` and
   `zerolite generate` take the same flags; the table sets the predicted decode step beside the
   measured one (generate's decode seconds over its decode steps).
3. In each group, plan's own choice (the tiers and prefetch depth searched, for this job: the group's
   prompts) run the same way; its job time (loading, prefill and decode, from generate's stats)
   beside the best hand-set policy's.
Each run is a fresh process; the three policies of a group run in turns, --rounds times, and their
medians are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Group:
    """Runs that share a model, a batch and the flags pinned in both the plan and the run."""
    name: str
    layout: Path
    batch: int
    pinned: tuple[str, ...]      # plan's and generate's flags alike
    prompt_tokens: int
    new_tokens: int
    mixed: bool = False          # each line asks its own count of new tokens, new_tokens // 8 to new_tokens
    needs: str | None = None     # the generate flag the group runs on (absent: the group is left out)

    @property
    def prompts(self) -> int:
        return 4 * self.batch if self.mixed else self.batch

    def asked(self) -> list[int]:
        """New tokens each prompt asks for."""
        if not self.mixed:
            return [self.new_tokens] * self.prompts
        low = max(self.new_tokens // 8, 1)
        return [low + (self.new_tokens - low) * i // (self.prompts - 1) for i in range(self.prompts)]


def groups(args) -> list[Group]:
    dense = args.dense
    every = []
    if "tiers" in args.groups:
        models = {"dense bf16": args.dense, "dense int4": args.int4, "MoE bf16": args.moe}
        every += [Group(model, layout, batch, (), args.prompt_tokens, args.new_tokens)
                  for model, layout in models.items() for batch in args.batch_sizes]
    long = args.kv_prompt_tokens
    if "kv-bits" in args.groups:
        every += [Group(f"K/V {bits} bits", dense, args.kv_batch, ("--kv-bits", str(bits)), long, args.new_tokens)
                  for bits in (16, 8, 4)]
    if "mixed" in args.groups:
        every.append(Group("mixed lengths", dense, args.kv_batch, (), args.prompt_tokens, 2 * args.new_tokens,
                           mixed=True))
    later = {  # the runtime's features that generate may not take yet: each joins where it does
        "kv-disk": Group("K/V half on disk", dense, args.kv_batch, ("--kv-disk", "0.5"), long, args.new_tokens,
                         needs="--kv-disk"),
        "micro-batches": Group("4 micro-batches", dense, args.kv_batch, ("--micro-batches", "4"), long,
                               args.new_tokens, needs="--micro-batches"),
        "cpu-attention": Group("attention on the CPU", dense, args.kv_batch,
                               ("--kv-offload", "1", "--kv-attention", "cpu"), long, args.new_tokens,
                               needs="--kv-attention"),
    }
    every += [group for name, group in later.items() if name in args.groups]
    return every


def generate_takes(flag: str) -> bool:
    help_text = subprocess.run([*ZEROLITE, "generate", "--help"], capture_output=True, text=True).stdout
    return flag in help_text


def plan(group: Group, flags: list[str]) -> dict:
    asked = group.asked()
    out = subprocess.run([*ZEROLITE, "plan", "--model", str(group.layout), "--json", "--prompt-tokens",
                          str(group.prompt_tokens), "--new-tokens", str(round(statistics.mean(asked))), "--prompts",
                          str(group.prompts), *group.pinned, *flags], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run(group: Group, flags: list[str], args, scratch: Path) -> dict:
    prompts = scratch / "prompts.jsonl"
    rng = random.Random(0)
    rows = [{"id": str(i), "input_ids": [rng.randrange(100, 30000) for _ in range(group.prompt_tokens)]}
            | ({"max_new_tokens": asked} if group.mixed else {}) for i, asked in enumerate(group.asked())]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stats = scratch / "stats.json"
    drop_page_cache()
    subprocess.run([*ZEROLITE, "generate", "--model", str(group.layout), "--input", str(prompts), "--output",
                    str(scratch / "out.jsonl"), "--max-new-tokens", str(group.new_tokens), "--stats-json", str(stats),
                    "--device", args.device, *group.pinned, *flags],
                   check=True, capture_output=True, text=True)
    (scratch / "out.jsonl").unlink()
    s = json.loads(stats.read_text())
    return {"decode_step_s": s["decode_s"] / max(s["decode_steps"], 1),
            "job_s": s["load_s"] + s["prefill_s"] + s["decode_s"], "load_s": s["load_s"], "prefill_s": s["prefill_s"]}


def measure(group: Group, args, scratch: Path, console: Console) -> tuple[list[dict], dict]:
    """The group's hand-set policies predicted and measured, and plan's choice beside the best of them."""
    tiers = {"all streamed": "0", "half in host": f"{half_the_layers(group.layout)}B"}
    policies = {tier: ["--batch-size", str(group.batch), "--cpu-memory", budget] for tier, budget in tiers.items()}
    predicted = {tier: plan(group, flags) for tier, flags in policies.items()}
    chosen = plan(group, ["--batch-size", str(group.batch)])
    policies["chosen"] = chosen["command"][chosen["command"].index("--batch-size"):]
    runs = {name: [] for name in policies}
    for _ in range(args.rounds):  # in turns, so that a drifting disk treats each alike
        for name, flags in policies.items():
            runs[name].append(run(group, flags, args, scratch))
    measured = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    cases = []
    for tier in tiers:
        error = predicted[tier]["decode_step_s"] / measured[tier]["decode_step_s"] - 1
        cases.append({"model": group.name, "tiers": tier, "batch": group.batch, "predicted": predicted[tier],
                      "measured": measured[tier], "error": error})
        console.print(f"{group.name}, {tier}, batch {group.batch}: predicted {predicted[tier]['decode_step_s']:.3f} s, "
                      f"measured {measured[tier]['decode_step_s']:.3f} s ({error:+.0%})", highlight=False)
    best = min(tiers, key=lambda tier: measured[tier]["job_s"])
    choice = {"model": group.name, "batch": group.batch, "flags": policies["chosen"], "predicted": chosen,
              "measured": measured["chosen"], "best_hand_set": best, "best_job_s": measured[best]["job_s"],
              "ratio": measured[best]["job_s"] / measured["chosen"]["job_s"]}
    console.print(f"{group.name}, batch {group.batch}: plan chose {' '.join(policies['chosen'])}: job "
                  f"{measured['chosen']['job_s']:.2f} s against {measured[best]['job_s']:.2f} s ({best}): "
                  f"{choice['ratio']:.2f}x", highlight=False)
    return cases, choice


GROUPS = ("tiers", "kv-bits", "mixed", "kv-disk", "micro-batches", "cpu-attention")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", type=Path, required=True, help="a bf16 layout")
    parser.add_argument("--int4", type=Path, help="the same model converted with --weights int4 (group tiers)")
    parser.add_argument("--moe", type=Path, help="a mixture-of-experts layout (group tiers)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--kv-prompt-tokens", type=int, default=512, help="prompts of the K/V groups")
    parser.add_argument("--kv-batch", type=int, default=8, help="the batch of every group but tiers")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS)
    parser.add_argument("--device", default="cpu", help="generate's --device (cpu-attention needs cuda)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each policy, in turns; medians are reported")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    if "tiers" in args.groups and not (args.int4 and args.moe):
        parser.error("the tiers group needs --int4 and --moe")
    console = Console(width=None if sys.stdout.isatty() else 160)

    subprocess.run([*ZEROLITE, "profile", "--disk", str(args.dense)], check=True)
    cases, choices = [], []
    with tempfile.TemporaryDirectory() as folder:
        for group in groups(args):
            if group.needs and not generate_takes(group.needs):
                console.print(f"{group.name}: left out, generate does not take {group.needs} yet", highlight=False)
                continue
            more, choice = measure(group, args, Path(folder), console)
            cases += more
            choices.append(choice)
    report(console, cases, choices, args)


def report(console: Console, cases: list[dict], choices: list[dict], args) -> None:
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
