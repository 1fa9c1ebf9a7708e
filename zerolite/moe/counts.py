"""What streaming a mixture per expert did: the bytes its experts took, the expert cache's hits and
the prefetch guess's record, as running totals; a run's share is the difference of two readings.

    before = lm.expert_counts()
    ...generate...
    lm.expert_counts().since(before).summary(bytes_read, steps)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zerolite.moe.guess import RELIABLE


@dataclass(frozen=True)
class ExpertCounts:
    expert_bytes: int = 0    # read from disk for experts (the rest of the bytes read: dense parts)
    cache_hits: int = 0      # experts found in the expert cache instead of read
    cache_lookups: int = 0
    guessed: int = 0         # experts the prefetch guessed for the next layer
    guessed_right: int = 0   # of them, routed to
    early_unused: int = 0    # guessed experts brought early that the router then did not pick
    spared_bytes: int = 0    # of their reads, the bytes given up before they started (not in expert_bytes)

    def since(self, before: ExpertCounts) -> ExpertCounts:
        return ExpertCounts(*(now - then for now, then in zip(dataclasses.astuple(self), dataclasses.astuple(before))))

    def summary(self, bytes_read: int, steps: int) -> dict:
        """Per step and as shares, as generate's summary and the profile report them."""
        steps = max(steps, 1)
        return {
            "dense_bytes_per_step": (bytes_read - self.expert_bytes) // steps,
            "expert_bytes_per_step": self.expert_bytes // steps,
            "expert_cache_hit_rate": round(self.cache_hits / self.cache_lookups, 4) if self.cache_lookups else None,
            "prefetch_guess_rate": round(self.guessed_right / self.guessed, 4) if self.guessed else None,
            "early_unused_experts_per_step": round(self.early_unused / steps, 3),
        }


def summary_line(summary: dict) -> str:
    """generate's and profile's line on a mixture streamed per expert, from summary()'s fields."""
    line = (f"experts: {summary['dense_bytes_per_step'] / 1e9:.3f} GB dense + "
            f"{summary['expert_bytes_per_step'] / 1e9:.3f} GB of experts read per step")
    if summary["expert_cache_hit_rate"] is not None:
        line += f"; expert cache hits {summary['expert_cache_hit_rate']:.0%}"
    if summary["prefetch_guess_rate"] is not None:
        line += (f"; next-layer guesses routed to {summary['prefetch_guess_rate']:.0%} (a guess's rank, first "
                 f"choice or second, is read early only while right {RELIABLE:.0%} of the time)")
    return line
