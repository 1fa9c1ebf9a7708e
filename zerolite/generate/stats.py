"""A generate job's totals and the clock that times its steps.

    clock = StepClock(on_step)                # generate's streamer: prefill and decode times
    stats.summary_lines(prompts)              # what generate says once done; stats.write(path): --stats-json
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from zerolite.convert.writer import write_atomically
from zerolite.moe.counts import ExpertCounts, summary_line
from zerolite.speculative.decoding import SpeculationStats


@dataclass
class RunStats:
    load_s: float = 0.0
    convert_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0          # generated tokens kept, over all prompts (up to and with the end token)
    decode_tokens: int = 0       # tokens produced by decode steps, over all rows
    decode_steps: int = 0        # the model's forwards after each batch's prefill
    bytes_read: int = 0
    forwards: int = 0            # passes over the weights: each batch's prefill and its decode steps
    experts: ExpertCounts | None = None  # a mixture streamed per expert: its expert bytes, cache and guesses
    peak_rss_bytes: int = 0
    peak_device_bytes: int | None = None
    speculation: SpeculationStats | None = None   # with a draft: its rounds, guesses and times
    ranks: int = 1               # the torchrun ranks these are the totals of

    @classmethod
    def across(cls, every: list[RunStats]) -> RunStats:
        """A job's totals over its ranks: counts add up, times and peaks are the largest rank's (the
        ranks run at once, each in a process of its own)."""
        def total(field: str):
            return sum(getattr(stats, field) for stats in every)

        def most(field: str):
            values = [getattr(stats, field) for stats in every if getattr(stats, field) is not None]
            return max(values) if values else None

        def added(field: str):
            parts = [getattr(stats, field) for stats in every if getattr(stats, field) is not None]
            return type(parts[0])(*map(sum, zip(*map(dataclasses.astuple, parts)))) if parts else None

        longest = ("load_s", "convert_s", "prefill_s", "decode_s", "peak_rss_bytes", "peak_device_bytes")
        return cls(**{f: most(f) for f in longest},
                   **{f: total(f) for f in ("new_tokens", "decode_tokens", "decode_steps", "bytes_read", "forwards")},
                   experts=added("experts"), speculation=added("speculation"), ranks=len(every))

    def write(self, path: Path) -> None:
        """The totals as JSON in path (--stats-json), written whole or not at all."""
        write_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def summary_lines(self, prompts: int) -> list[str]:
        """What generate says on stderr once the job is done: tokens and times, a mixture's expert
        reads, a draft's guesses."""
        summary = self.to_dict()
        ranks = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        lines = [f"{self.new_tokens} new tokens for {prompts} prompt{'s' if prompts != 1 else ''}{ranks}; prefill "
                 f"{self.prefill_s:.2f} s, decode {self.decode_s:.2f} s ({summary['decode_tokens_per_s'] or 0:.1f} "
                 f"tokens/s{' in all' if ranks else ''}), {self.bytes_read / 1e9:.2f} GB read"]
        if self.experts is not None:
            lines.append(summary_line(summary))
        spec = self.speculation
        if spec is not None and spec.drafted:
            lines.append(f"draft: {spec.accepted} of {spec.drafted} guesses kept ({summary['acceptance_rate']:.0%}), "
                         f"{summary['tokens_per_pass']:.2f} tokens per pass over the weights; {spec.draft_s:.2f} s "
                         f"drafting, {spec.target_s:.2f} s in the model's passes")
        return lines

    def to_dict(self) -> dict:
        return {
            "load_s": round(self.load_s, 4),
            "convert_s": round(self.convert_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "new_tokens": self.new_tokens,
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 3) if self.decode_s > 0 else None,
            "decode_steps": self.decode_steps,
            # above 1 per row only with a draft: the tokens each pass over the weights made
            "tokens_per_pass": round(self.decode_tokens / self.decode_steps, 3) if self.decode_steps else None,
            "bytes_read": self.bytes_read,
            **(self.experts.summary(self.bytes_read, self.forwards) if self.experts is not None else {}),
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            **({"ranks": self.ranks} if self.ranks > 1 else {}),
            **(self.speculation.to_dict() if self.speculation is not None else {}),
        }


class StepClock(BaseStreamer):
    """Times generate's steps through its streamer hook: the first put is the prompt, every later
    put the tokens one forward made (one per row; several for one row when a draft's guesses were
    checked in that forward). Prefill ends at the second put, decode at the last."""

    def __init__(self, on_step: Callable[[int], None]):
        self.on_step = on_step
        self.times: list[float] = []
        self.tokens: list[int] = []   # tokens each put carried

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(value.numel())
        if len(self.times) > 1:
            self.on_step(value.numel())

    def end(self) -> None:
        pass

    @property
    def prefill_s(self) -> float:
        return self.times[1] - self.times[0] if len(self.times) > 1 else 0.0

    @property
    def decode_s(self) -> float:
        return self.times[-1] - self.times[1] if len(self.times) > 2 else 0.0

    @property
    def decode_steps(self) -> int:
        """Forwards of the model after the prefill."""
        return max(len(self.times) - 2, 0)

    @property
    def decode_tokens(self) -> int:
        """Tokens those forwards made, over all rows."""
        return sum(self.tokens[2:])
