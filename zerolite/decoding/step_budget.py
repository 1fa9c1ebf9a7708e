"""--step-tokens auto: how many tokens one step may compute over the whole batch, set so that the
prompts joining ride along in the time the step waits for its reads anyway.

    budget = StepBudget(None)             # auto; StepBudget(512) stays at 512
    batch.step_tokens = budget.tokens
    ... one step computing n tokens in t seconds ...
    budget.observe(n, t)

A step over streamed weights takes the longer of its reads and its compute. Decoding rows compute
one token each, which hides under the reads; a prompt joining adds its chunk to every row (the
decoding ones pad it), which can make the step compute-bound, and then every other client waits
for it. The shortest recent step stands for the reads' time. Of the steps that used at least half
the budget: one well over the reads' time was set by its compute, and the budget drops to the
tokens that would have fit; one that took no longer than the reads lets it grow. On a GPU the
budget climbs to its ceiling (whole prompts join in one step); on a CPU it settles where the
compute meets the disk: the fewer tokens, the faster the disk or the slower the cores.
"""

from __future__ import annotations

START = 256          # tokens, before anything was measured
FLOOR = 16
CEILING = 8192
COMPUTE_BOUND = 1.15  # a step this much over the reads' time was set by its compute
GROWTH = 1.5          # until the compute first showed, then
SETTLED_GROWTH = 1.125  # so that the budget hovers near where compute meets the reads, not 1.5x past it
READ_DRIFT = 1.02     # the reads' estimate may rise this much a step (a disk that slowed down)


class StepBudget:
    def __init__(self, fixed: int | None):
        self.fixed = fixed is not None
        self.tokens = fixed if fixed is not None else START
        self.read_s: float | None = None   # the shortest recent step
        self.growth = GROWTH

    def observe(self, computed: int, seconds: float) -> None:
        """computed: tokens the step computed over all rows (the padding included)."""
        if self.fixed or computed <= 0:
            return
        self.read_s = seconds if self.read_s is None else min(seconds, self.read_s * READ_DRIFT)
        if computed < self.tokens / 2:
            return  # a step of decoding rows only: the budget did not shape it (nor does its jitter tell anything)
        if seconds > COMPUTE_BOUND * self.read_s:
            self.tokens = max(FLOOR, int(computed * self.read_s / seconds))
            self.growth = SETTLED_GROWTH
        else:
            self.tokens = min(CEILING, int(self.tokens * self.growth))
