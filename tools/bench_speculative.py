"""Speculative decoding against plain streamed decoding of the same model at batch 1: speed-up,
guesses kept, tokens per pass over the weights, and whether the tokens are the same. Run as root
(the page cache is dropped before each run).

    python tools/bench_speculative.py [--model LAYOUT] [--drafts self-int4,self-int4:128]
                                      [--prompts 10] [--new-tokens 64] [--json out.json]

Each variant is `zerolite generate --cpu-memory 0 --batch-size 1` in a fresh process, every layer
streamed from disk at every step, as a user runs it: first plain, then with each --drafts entry
(DRAFT or DRAFT:GROUP_SIZE, as --draft and --draft-group-size). With no --model, the built-in
SmolLM2-135M-Instruct answers --prompts chat questions (--chat); a model without a chat template
gets random prompts of 16 token ids (seed 0).

Greedy tokens should equal the plain run's. Where a prompt's differ, the model's own logits at the
first difference are shown: a pass over k + 1 tokens rounds its sums otherwise than k + 1 passes
over one, so two tokens whose logits lie within that rounding may swap places, and greedy decoding
goes on from the other one. Within that rounding: the model's top two, and the two runs' tokens,
no further apart than NEAR_TIE or one step of the logits' dtype at their size (bf16 logits near 3
lie 2^-6 = 0.0156 apart, or are equal).

Beside each draft: how often its top token is the model's on the plain run's tokens (teacher-forced,
both in one forward), and the ceiling that sets: no draft length gives more than 1 / (1 - a)
tokens per pass when each guess is kept with probability a, and a pass costs at least a plain step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import zerolite  # first: it sets torch's thread waits before torch loads (zerolite.openmp)

# isort: split
import torch
from rich.console import Console
from rich.table import Table

from zerolite.convert.resolve import ensure_layout
from zerolite.generate.prompts import Prompt
from zerolite.generate.run import encode
from zerolite.lm.loading import load_draft
from zerolite.planner.machine import drop_page_cache
from zerolite.runtime.opening import Opened

NEAR_TIE = 1e-4
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in simple terms.",
    "Give me three tips for learning Python.", "What causes rain?", "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?", "What is the difference between a virus and a bacterium?",
    "Suggest a name for a pet cat.", "Why is the sky blue?", "How do vaccines work?", "What is a black hole?",
]
RANDOM_PROMPT_TOKENS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a layout or checkpoint (default: the built-in model)")
    parser.add_argument("--drafts", default="self-int4,self-int4:128", help="comma-separated DRAFT or DRAFT:GROUP_SIZE")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    layout = ensure_layout(args.model, None, None, False, True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    prompts_file, chat = write_prompts(layout, args.prompts, scratch / "prompts.jsonl")

    variants = [("plain", None, None)] + [parse_draft(text) for text in args.drafts.split(",")]
    runs = {}
    for number, (name, draft, group_size) in enumerate(variants):  # a name may be a path: folders by number
        runs[name] = run(layout, prompts_file, chat, args.new_tokens, draft, group_size, scratch / f"run{number}")
    plain = runs["plain"]
    with zerolite.load(layout, offload="cpu", device="cpu", show_progress=False) as lm:
        rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
        encoded = encode(lm, [Prompt(str(r["id"]), r.get("prompt"), r.get("input_ids")) for r in rows], chat)
        sequences = {i: torch.tensor([encoded[int(i)] + plain["tokens"][i]]) for i in plain["tokens"]}
        model_logits = {i: logits_of(lm.model, ids) for i, ids in sequences.items()}
        for (_name, draft, group_size), result in zip(variants, runs.values()):
            speed_up = result["stats"]["decode_tokens_per_s"] / plain["stats"]["decode_tokens_per_s"]
            result["speed_up"] = round(speed_up, 3)
            result["differences"] = differences(encoded, model_logits, plain["tokens"], result["tokens"],
                                                lm.model.dtype)
            if draft is not None:
                result["agreement"] = agreement(lm, draft, group_size, encoded, sequences, model_logits)
    report(Console(width=180), runs, layout, chat)
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(layout), "cpu": cpu_name(), "runs": runs}, indent=2) + "\n")


def parse_draft(text: str) -> tuple[str, str, int | None]:
    draft, _, group = text.partition(":")
    return text, draft, int(group) if group else None


def write_prompts(layout: Path, count: int, path: Path) -> tuple[Path, bool]:
    """Chat questions where the model has a chat template, else random token ids."""
    from zerolite.hf import load_tokenizer

    tokenizer = load_tokenizer(layout)
    chat = tokenizer is not None and bool(tokenizer.chat_template)
    generator = torch.Generator().manual_seed(0)
    vocab = zerolite_vocab(layout)
    with path.open("w") as f:
        for i in range(count):
            if chat:
                row = {"id": i, "prompt": QUESTIONS[i % len(QUESTIONS)]}
            else:
                row = {"id": i,
                       "input_ids": torch.randint(3, vocab, (RANDOM_PROMPT_TOKENS,), generator=generator).tolist()}
            f.write(json.dumps(row) + "\n")
    return path, chat


def zerolite_vocab(layout: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(layout).get_text_config().vocab_size


def run(layout: Path, prompts: Path, chat: bool, new_tokens: int, draft: str | None, group_size: int | None,
        out: Path) -> dict:
    out.mkdir()
    command = [sys.executable, "-m", "zerolite", "generate", "--model", str(layout), "--input", str(prompts),
               "--output", str(out / "out.jsonl"), "--stats-json", str(out / "stats.json"), "--cpu-memory", "0",
               "--batch-size", "1", "--max-new-tokens", str(new_tokens)] + (["--chat"] if chat else [])
    if draft is not None:
        command += ["--draft", draft] + (["--draft-group-size", str(group_size)] if group_size else [])
    if not drop_page_cache():
        print("bench_speculative: cannot drop the page cache (not root): reads may come from memory", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_speculative: {' '.join(command)} failed:\n{done.stderr}")
    rows = [json.loads(line) for line in (out / "out.jsonl").read_text().splitlines()]
    plan = [line for line in done.stderr.splitlines() if line.startswith("draft: ") and "held on" in line]
    return {"command": " ".join(command[2:]), "stats": json.loads((out / "stats.json").read_text()),
            "tokens": {str(row["id"]): row["token_ids"] for row in rows}, "draft_plan": plan[0] if plan else None}


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def differences(encoded: list[list[int]], model_logits: dict, plain: dict, drafted: dict,
                dtype: torch.dtype) -> list[dict]:
    """For each prompt whose tokens differ: where, and the model's top-2 gap there (its own logits,
    in one forward over the prompt and the plain run's tokens)."""
    found = []
    for i in (i for i in plain if plain[i] != drafted[i]):
        a, b = plain[i], drafted[i]
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        logits = model_logits[i][len(encoded[int(i)]) - 1 + at]
        top = logits.topk(2)
        found.append({"id": i, "position": at, "plain": a[at] if at < len(a) else None,
                      "drafted": b[at] if at < len(b) else None, "top2": top.indices.tolist(),
                      "top2_gap": float(top.values[0] - top.values[1]),
                      # the two runs' own tokens: both near the top, or one far below it
                      "choices_gap": float(abs(logits[a[at]] - logits[b[at]])) if at < min(len(a), len(b)) else None,
                      "rounding": max(NEAR_TIE, torch.finfo(dtype).eps * float(top.values[0].abs()))})
    return found


def agreement(lm, draft: str, group_size: int | None, encoded: list[list[int]], sequences: dict,
              model_logits: dict) -> dict:
    """How often the draft's top token is the model's, on the plain run's tokens (teacher-forced),
    and what that allows: with each guess kept with probability a, no draft length gives more than
    1 / (1 - a) tokens per pass over the weights, however cheap the guesses."""
    same = total = 0
    with load_draft(draft, group_size, Opened(lm.layout, lm.device, lm.tokenizer), False) as draft_lm:
        for i, ids in sequences.items():
            new = slice(len(encoded[int(i)]) - 1, ids.shape[1] - 1)  # the positions that predict new tokens
            guessed = logits_of(draft_lm.model, ids)[new].argmax(-1)
            same += int((guessed == model_logits[i][new].argmax(-1)).sum())
            total += guessed.numel()
    share = same / total
    return {"top1": round(share, 4), "most_tokens_per_pass": round(1 / (1 - share), 2) if share < 1 else None}


def report(console: Console, runs: dict, layout: Path, chat: bool) -> None:
    table = Table(title=f"speculative decoding, {layout.name}: batch 1, every layer streamed from disk ({cpu_name()})")
    for column in ("variant", "decode tokens/s", "speed-up", "guesses kept", "tokens per pass", "top-1 agreement",
                   "drafting s", "model passes s", "GB read", "tokens as plain"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, result in runs.items():
        s = result["stats"]
        same = sum(result["tokens"][i] == runs["plain"]["tokens"][i] for i in result["tokens"])
        table.add_row(name, f"{s['decode_tokens_per_s']:.2f}", f"{result['speed_up']:.2f}x",
                      f"{s['acceptance_rate']:.1%}" if s.get("acceptance_rate") is not None else "-",
                      f"{s['tokens_per_pass']:.2f}", agreed(result.get("agreement")), f"{s.get('draft_s', 0):.2f}",
                      f"{s.get('target_s', s['decode_s']):.2f}", f"{s['bytes_read'] / 1e9:.2f}",
                      f"{same}/{len(result['tokens'])}")
    console.print(table)
    for name, result in runs.items():
        if result["draft_plan"]:
            console.print(f"{name}: {result['draft_plan']}")
        for d in result["differences"]:
            tie = d["top2_gap"] <= d["rounding"] and d["choices_gap"] is not None and d["choices_gap"] <= d["rounding"]
            console.print(f"{name}: prompt {d['id']} differs at new token {d['position']} ({d['plain']} plain, "
                          f"{d['drafted']} drafted; the model's top two {d['top2']} are {d['top2_gap']:.2e} apart, the "
                          f"two runs' tokens {d['choices_gap']:.2e}, the logits' rounding {d['rounding']:.2e}: "
                          f"{'a near-tie' if tie else 'NOT a near-tie'})")
    if not chat:
        console.print("random weights: how often a draft's guesses are kept says little about a trained model's")


def agreed(figures: dict | None) -> str:
    if figures is None:
        return "-"
    most = figures["most_tokens_per_pass"]
    return f"{figures['top1']:.1%} (at most {most:.2f} per pass)" if most is not None else f"{figures['top1']:.1%}"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
