"""The one decoding loop of both front ends: sequences wait, join the running batch at a step
boundary as places free up, and leave it the step their end comes. The server's DecodeLoop turns
it on its own thread for HTTP requests; `zerolite generate --input` turns it for a file's prompts.

    decoder = Decoder(lm, max_batch=8, step_tokens=None)        # None: the step budget finds its own
    decoder.waiting.extend(sequences)
    while decoder.busy:
        advances = decoder.join(decoder.next_joining())          # prefilled apart: their first tokens
        advances += decoder.step()                               # each row that got its next token
        ... advance.token, advance.text, advance.reason ...
        decoder.leave([a.row for a in advances if a.reason])

A finished sequence's place goes to the next one waiting at the next step, so no place idles
while its neighbours finish (continuous batching); each row's tokens are those of its prompt alone
(RunningBatch), so what a sequence gets does not depend on what shares the batch.

Where a joining prompt is fed is the one choice between the front ends. The server feeds it in the
running batch's steps, in chunks the step budget sizes to hide under the step's reads, so that no
client waits on another's prompt. generate (prefill_apart) feeds the joining prompts whole in a
forward of their own and merges their K/V into the batch: in a shared step every decoding row is
padded to the prompt's chunk, which a compute-bound step (weights in memory, a CPU) pays for in
full, while a forward apart costs one more pass over the weights per join.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from zerolite.decoding.running_batch import Row, RunningBatch
from zerolite.decoding.step_budget import StepBudget
from zerolite.decoding.text_stream import TextStream
from zerolite.decoding.token_choice import TokenChoice

WHOLE_PROMPTS = 1 << 30   # a step budget that feeds every joining prompt whole in one forward


@dataclass(eq=False)
class Sequence:
    """One prompt's generation: a row of the running batch while it runs."""
    index: int                       # the server: its choice's index in the response; generate: the prompt's
    prompt_ids: list[int]
    max_tokens: int
    choice: TokenChoice
    text: TextStream | None          # None: no tokenizer, token ids only
    stop_ids: frozenset[int]         # end tokens
    request: object = None           # the server's Request it belongs to; None in a generate job
    generated: list[int] = field(default_factory=list)

    def add(self, token: int) -> tuple[str, str | None]:
        """The end rule of both front ends and both of generate's batchings: token joins the
        sequence; returns the text now safe to show and, once the sequence is done, why: "stop"
        (an end token, or a stop string, whose text is not shown) or "length"."""
        self.generated.append(token)
        reason, text = None, ""
        if token in self.stop_ids:
            reason = "stop"
        elif self.text is not None:
            text, stopped = self.text.add(token)
            reason = "stop" if stopped else None
        if reason is None and len(self.generated) >= self.max_tokens:
            reason = "length"
        if reason is not None and self.text is not None:
            text += self.text.finish()  # after a stop string, nothing is held back
        return text, reason


@dataclass(frozen=True)
class Advance:
    """A row's step: the token chosen, its text, and why the sequence ended (None: it goes on);
    or, when choosing raised, the error (token None)."""
    row: Row
    token: int | None
    text: str = ""
    reason: str | None = None
    error: Exception | None = None

    @property
    def sequence(self) -> Sequence:
        return self.row.owner


class Decoder:
    def __init__(self, lm, max_batch: int, step_tokens: int | None, prefill_apart: bool = False):
        """step_tokens: the most tokens a step computes over the batch; None: as many as hide
        under the step's reads (zerolite.decoding.step_budget). prefill_apart: joining prompts are fed
        whole in a forward of their own (join), not in the batch's steps."""
        self.lm = lm
        self.max_batch = max_batch
        self.budget = StepBudget(step_tokens)
        self.batch = RunningBatch(lm, self.budget.tokens)
        # a sliding window caps a forward's columns, so a long prompt would take several forwards apart
        self.prefill_apart = prefill_apart and self.batch.max_columns is None
        self.waiting: deque[Sequence] = deque()
        self.step_s = 0.0                # the last step's time: its forward and its choices
        self.join_s = 0.0                # the last join's: its prefill apart, where there was one

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.batch.rows)

    @property
    def prefilling(self) -> bool:
        """Some row has yet to choose its first token: the next step carries prompt tokens."""
        return any(not row.owner.generated for row in self.batch.rows)

    def next_joining(self) -> list[Sequence]:
        """The waiting sequences that the batch's free places take, first come first; out of the
        queue, in nobody's batch until join."""
        joining = []
        while self.waiting and len(self.batch.rows) + len(joining) < self.max_batch:
            joining.append(self.waiting.popleft())
        return joining

    def join(self, sequences: list[Sequence]) -> list[Advance]:
        """The sequences join the batch. Prefilled apart, their prompts are fed now, and each has
        chosen its first token (the advances; the ended ones stay until leave()); otherwise they
        are fed in the coming steps, and nothing is chosen yet."""
        rows = [Row(list(s.prompt_ids), owner=s) for s in sequences]
        if not self.prefill_apart:
            self.batch.add(rows)
            return []
        if not rows:
            return []
        started = time.perf_counter()
        joining = RunningBatch(self.lm, WHOLE_PROMPTS)
        joining.add(rows)
        try:
            advances = self._choose(joining.step())
        except BaseException:
            joining.reset()
            raise
        self.batch.merge(joining)
        self.join_s = time.perf_counter() - started
        return advances

    def step(self) -> list[Advance]:
        """One forward over every row, then each row whose prompt is all fed chooses its next
        token. A row that goes on feeds it next step; the ended ones stay until leave()."""
        started = time.perf_counter()
        self.batch.step_tokens = self.budget.tokens
        advances = self._choose(self.batch.step())
        self.step_s = time.perf_counter() - started
        self.budget.observe(self.batch.computed, self.step_s)
        return advances

    def _choose(self, done: list) -> list[Advance]:
        advances = []
        for row, logits in done:
            sequence: Sequence = row.owner
            try:
                token = sequence.choice.pick(logits)
                text, reason = sequence.add(token)
            except Exception as e:  # noqa: BLE001 - the caller decides whom it fails (the server: its request only)
                advances.append(Advance(row, None, error=e))
                continue
            if reason is None:
                row.pending = [token]
            advances.append(Advance(row, token, text, reason))
        return advances

    def leave(self, rows: list[Row]) -> None:
        self.batch.remove(rows)
