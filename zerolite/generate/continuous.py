"""`zerolite generate --batching continuous`: a file's prompts through the server's decoding loop
(decoding.decoder), so that a prompt takes the place of one that finished at the next step instead
of waiting for the longest of its batch to end.

    run_continuous(lm, prompts, encoded, todo, sampling, batch_size=8, on_batch=write, stats=stats, progress=bar)

Prompts join in input order. Their completions are handed on in input order too, each as soon as
every earlier prompt's is (ReleaseInOrder), so the output holds the same lines in the same order
as batch after batch, and a killed run's file is a prefix of the input: the rerun goes on from it.
"""

from __future__ import annotations

from collections.abc import Callable

from zerolite.decoding.decoder import Advance, Decoder
from zerolite.decoding.running_batch import RunningBatch
from zerolite.decoding.token_choice import rules_beyond_choice
from zerolite.errors import ZeroliteError
from zerolite.generate.prompts import Completion, Prompt
from zerolite.generate.sequences import completion, sequence_for
from zerolite.generate.stats import RunStats
from zerolite.sampling import Sampling
from zerolite.text import end_token_ids


class ReleaseInOrder:
    """Completions come in the order their sequences end; on_batch gets them in input order."""

    def __init__(self, positions: list[int], on_batch: Callable[[list[Completion]], None]):
        self.order = positions            # the positions to complete, in input order
        self.next = 0                     # the first of them not handed on yet
        self.ready: dict[int, Completion] = {}
        self.on_batch = on_batch

    def add(self, finished: dict[int, Completion]) -> None:
        """finished: one step's completions by position; those now at the front are handed on together."""
        self.ready.update(finished)
        start = self.next
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            self.next += 1
        if self.next > start:
            self.on_batch([self.ready.pop(p) for p in self.order[start:self.next]])


def run_continuous(lm, prompts: list[Prompt], encoded: list[list[int]], todo: list[int], sampling: Sampling,
                   batch_size: int, on_batch: Callable[[list[Completion]], None], stats: RunStats,
                   progress) -> None:
    """Completes prompts[i] for every i in todo (input order), at most batch_size at once.

    Joining prompts are prefilled apart (Decoder's prefill_apart), in a forward that counts as
    prefill in the stats; the steps of the running batch count as decode."""
    eos_ids = end_token_ids(lm.generation_config)
    decoder = Decoder(lm, batch_size, step_tokens=None, prefill_apart=True)
    decoder.waiting.extend(sequence_for(lm, prompts[i], i, encoded[i], sampling, eos_ids) for i in todo)
    shown: dict[int, list[str]] = {i: [] for i in todo}
    release = ReleaseInOrder(todo, on_batch)

    def take(advances: list[Advance]) -> None:
        """The advances' tokens to their sequences, the ended ones out of the batch and on to on_batch."""
        finished = {}
        for advance in advances:
            if advance.error is not None:
                raise advance.error
            sequence = advance.sequence
            shown[sequence.index].append(advance.text)
            if advance.reason is not None:
                finished[sequence.index] = completion(lm, prompts[sequence.index], sequence, advance.reason,
                                                      "".join(shown.pop(sequence.index)))
                progress.advance(sequence.max_tokens - len(sequence.generated))  # the tokens it did not need
        decoder.leave([advance.row for advance in advances if advance.reason is not None])
        progress.advance(len(advances))
        stats.new_tokens += sum(len(c.token_ids) for c in finished.values())
        release.add(finished)

    while decoder.busy:
        joined = decoder.join(decoder.next_joining())
        if joined:
            count(stats, True, decoder.join_s, len(joined))
            take(joined)
        if decoder.batch.rows:
            prefilling = decoder.prefilling
            advances = decoder.step()
            count(stats, prefilling, decoder.step_s, len(advances))
            take(advances)


def count(stats: RunStats, prefilling: bool, seconds: float, tokens: int) -> None:
    stats.forwards += 1
    if prefilling:
        stats.prefill_s += seconds
        return
    stats.decode_s += seconds
    stats.decode_steps += 1
    stats.decode_tokens += tokens


def choose_continuous(lm, batching: str | None, sampling: Sampling) -> bool:
    if batching not in (None, "continuous", "static"):
        raise ZeroliteError(f"`batching` must be continuous or static, got {batching!r}")
    if batching == "static":
        return False
    reason = why_not_continuous(lm, sampling)
    if reason is not None and batching == "continuous":
        raise ZeroliteError(f"`batching` continuous cannot run here: {reason}; use `batching` static")
    return reason is None


def why_not_continuous(lm, sampling: Sampling) -> str | None:
    """What keeps this job off the running batch, which decodes one token per row per step with
    the server's token choice, over a cache of K/V columns; None: nothing."""
    if lm.world.size > 1:
        return "under torchrun the prompts are dealt out to the ranks batch by batch"
    if lm.draft is not None:
        return "a draft's speculative decoding runs one prompt at a time, through transformers' generate"
    if lm.policy.micro_batches > 1:
        return "micro-batches split batches that start together, each with a cache of its own"
    rules = rules_beyond_choice(sampling.generation_config(lm.generation_config, pad_id=0))
    if rules:
        return f"the model's generation config sets {', '.join(rules)}, which only transformers' generate applies"
    try:
        RunningBatch(lm, step_tokens=1)
    except ZeroliteError:
        return "this model keeps other state than attention's K/V columns"
    return None
