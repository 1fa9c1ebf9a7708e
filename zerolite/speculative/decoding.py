"""Speculative decoding: the resident draft guesses k tokens, one pass of the streamed target over
its weights checks all of them, and what is kept is exactly what the target alone would make
(greedy), or is drawn from exactly its distribution (sampling, by the rejection rule of Leviathan
et al., 2023: "Fast Inference from Transformers via Speculative Decoding").

    speculator = Speculator(draft_model, timeline)
    model.generate(input_ids, custom_generate=speculative_decoding, speculator=speculator, ...)

transformers' generate prepares everything as it does for its own decoding (the logits processors
that apply temperature, top-k and top-p, the stopping criteria, the target's cache, zerolite's K/V
offload included) and runs the loop below in place of its own. A pass over streamed weights costs
about the same for k + 1 tokens as for one, since the bytes, not the arithmetic, set its time: the
draft length is chosen from what was measured (DraftLength), each round.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from zerolite.hf import cache_keyword
from zerolite.runtime.timeline import NO_TIMELINE

LONGEST_DRAFT = 16
FIRST_DRAFT = 4          # before anything is measured
ACCEPTANCE_PRIOR = 1.0   # one kept and one rejected guess, as if seen before the first round
MEMORY = 0.9             # each round's weight against the rounds before: acceptance moves with the text


@dataclass
class SpeculationStats:
    passes: int = 0          # the target's forwards after its prefill
    drafted: int = 0         # guesses the draft made
    accepted: int = 0        # guesses the target kept
    draft_s: float = 0.0     # time in the draft's forwards
    target_s: float = 0.0    # time in the target's forwards after its prefill

    def since(self, before: SpeculationStats) -> SpeculationStats:
        return SpeculationStats(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))

    def to_dict(self) -> dict:
        """What generate's --stats-json and profile's report say of the guesses."""
        return {
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            # guesses kept / guesses made (a guess after the first miss of a round counts as not kept)
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "draft_s": round(self.draft_s, 4),
            "target_s": round(self.target_s, 4),
        }


class DraftLength:
    """The draft length worth the most tokens per second, from measured acceptance and costs.

    With each guess kept with probability a (until the first one rejected), k guesses give
    (1 - a^(k+1)) / (1 - a) tokens per round (the kept ones and the target's own), and a round
    costs one target pass and k draft steps: k maximises their ratio. k = 0, plain decoding, wins
    where a guess costs more than it saves (then nothing more is learnt of acceptance, and the draft
    is not used again in that run). a is estimated as kept / (kept + rejected): a round that kept
    all its guesses saw no rejection. Recent rounds weigh more.
    """

    def __init__(self, draft_step_s: float | None = None) -> None:
        self.kept = ACCEPTANCE_PRIOR
        self.rejected = ACCEPTANCE_PRIOR
        self.draft_step_s = draft_step_s  # as timed at load, until rounds are measured
        self.target_pass_s: float | None = None

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def choose(self) -> int:
        if self.draft_step_s is None or self.target_pass_s is None:
            return FIRST_DRAFT
        return max(range(0, LONGEST_DRAFT + 1),
                   key=lambda k: expected_tokens(self.acceptance, k) / (self.target_pass_s + k * self.draft_step_s))

    def record(self, drafted: int, kept: int, draft_s: float, target_s: float) -> None:
        self.kept = self.kept * MEMORY + kept
        self.rejected = self.rejected * MEMORY + (1 if kept < drafted else 0)
        if drafted:
            self.draft_step_s = average(self.draft_step_s, draft_s / drafted)
        self.target_pass_s = average(self.target_pass_s, target_s)


def average(old: float | None, new: float) -> float:
    return new if old is None else MEMORY * old + (1 - MEMORY) * new


class Speculator:
    """The draft model, how long its guesses should be, and what speculation has done so far."""

    def __init__(self, draft_model, timeline=NO_TIMELINE, draft_step_s: float | None = None):
        self.model = draft_model
        self.timeline = timeline
        self.length = DraftLength(draft_step_s)
        self.stats = SpeculationStats()


class Forwards:
    """One model's forwards along a growing sequence, with its own cache: each call feeds the
    tokens the cache has not seen yet; rewind() forgets those past a length."""

    def __init__(self, model, cache, attention_mask: torch.Tensor | None, extra: dict, positions: bool):
        self.model = model
        self.cache = cache
        self.prompt_mask = attention_mask
        self.extra = extra  # other model inputs generate prepared (use_cache and the like)
        self.positions = positions  # pass position ids (where generate did): counted along the mask
        self.seen = 0

    def __call__(self, input_ids: torch.Tensor, logits: int) -> torch.Tensor:
        """The fp32 logits of the last `logits` positions of input_ids."""
        length = input_ids.shape[1]
        mask = torch.ones((1, length), dtype=torch.long, device=input_ids.device)
        if self.prompt_mask is not None:
            mask[:, : self.prompt_mask.shape[1]] = self.prompt_mask
        extra = dict(self.extra)
        if self.positions:
            extra["position_ids"] = (mask.cumsum(-1) - 1).clamp_(min=0)
        inputs = self.model.prepare_inputs_for_generation(
            input_ids, next_sequence_length=length - self.seen if self.seen else None,
            attention_mask=mask, **{cache_keyword(): self.cache}, is_first_iteration=self.seen == 0, **extra)
        if self.model._supports_logits_to_keep():
            inputs["logits_to_keep"] = logits
        out = self.model(**inputs)
        if not self.seen and hasattr(self.cache, "activate_past_recording"):  # transformers >= 5.x's caches
            # After the prefill, as transformers' assisted decoding does: a sliding window's layers
            # (and a state's) then keep what a rewind may need, until the round's crop trims them.
            self.cache.activate_past_recording()
        self.seen = length
        return out.logits[:, -logits:].float()

    def rewind(self, length: int) -> None:
        """Forgets the tokens past length (transformers 5 crops by the count to remove, negative); at
        every round, even with none to forget, as crop(0) trims a window back to its size. Not
        before the first forward (a round that drafted nothing): a window's crop needs its states."""
        if self.seen:
            self.cache.crop(min(length - self.seen, 0))
            self.seen = min(self.seen, length)


def speculative_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         synced_gpus=False, streamer=None, speculator: Speculator | None = None, **model_kwargs):
    """transformers' custom_generate: decoding at batch 1 in rounds of draft, check and keep.

    1. the target's prefill makes the first token, as plain decoding does
    2. the draft guesses k tokens, k from DraftLength, feeding first what it has not seen yet
    3. one target pass over the last token and the k guesses gives k + 1 distributions
    4. keep the guesses up to the first the target rejects, then one token of the target's own
       (greedy: its argmax; sampling: drawn from what the rejection rule leaves)
    5. stop where a stopping criterion says so, token by token; else crop both caches to what was kept
    """
    sample = generation_config.do_sample
    # what generate prepared for the prompt alone; Forwards makes them anew for each forward
    per_forward = (cache_keyword(), "attention_mask", "position_ids", "logits_to_keep")
    extra = {k: v for k, v in model_kwargs.items() if k not in per_forward}
    mask, positions = model_kwargs.get("attention_mask"), "position_ids" in model_kwargs
    target = Forwards(model, model_kwargs[cache_keyword()], mask, extra, positions)
    draft = Forwards(speculator.model, DynamicCache(config=speculator.model.config), mask, {"use_cache": True},
                     positions)
    stats, length, timeline = speculator.stats, speculator.length, speculator.timeline

    distribution = processed(logits_processor, input_ids, target(input_ids, 1)[:, 0], sample)
    input_ids, finished = keep(input_ids, pick(distribution, sample), distribution, stopping_criteria, streamer)
    while not finished:
        room = generation_config.max_length - input_ids.shape[1] - 1
        k = max(0, min(length.choose(), room))

        started = time.perf_counter()
        guesses, guessed = input_ids, []
        if k:
            with timeline.span("draft", f"draft {stats.passes}", tokens=k):
                guesses, guessed = guess(draft, logits_processor, input_ids, k, sample)
        drafted = time.perf_counter()

        logits = target(guesses, k + 1)
        p = torch.stack([processed(logits_processor, guesses[:, : input_ids.shape[1] + i], logits[:, i], sample)
                         for i in range(k + 1)], dim=1)
        kept, tokens = judge(guesses[:, input_ids.shape[1]:], p, guessed, sample)
        checked = time.perf_counter()

        stats.passes += 1
        stats.drafted += k
        stats.accepted += kept
        stats.draft_s += drafted - started
        stats.target_s += checked - drafted
        length.record(k, kept, drafted - started, checked - drafted)

        input_ids, finished = keep(input_ids, tokens, p[:, : tokens.shape[1]], stopping_criteria, streamer)
        target.rewind(input_ids.shape[1] - 1)
        draft.rewind(input_ids.shape[1] - 1)
    if streamer is not None:
        streamer.end()
    return input_ids


def guess(draft: Forwards, logits_processor, input_ids: torch.Tensor, k: int, sample: bool):
    """(input_ids and k guesses, the k distributions they were drawn from): the draft's round."""
    guesses, guessed = input_ids, []
    with one_thread():
        for _ in range(k):
            q = processed(logits_processor, guesses, draft(guesses, 1)[:, 0], sample)
            guessed.append(q)
            guesses = torch.cat([guesses, pick(q, sample)], dim=1)
        # on the host: the draft's work is done (on a GPU too), and its time is measured
        return guesses.cpu().to(input_ids.device), guessed


@contextmanager
def one_thread():
    """The draft computes on one CPU thread. Its ops are small, and torch's other threads, which
    sleep between them (zerolite.openmp), cost more to wake than they save. The other cores read
    the model's next layers meanwhile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def processed(logits_processor, prefix: torch.Tensor, logits: torch.Tensor, sample: bool) -> torch.Tensor:
    """The next token's distribution after the logits processors (temperature, top-k, top-p, ...):
    probabilities when sampling, the processed logits when greedy."""
    scores = logits_processor(prefix, logits)
    return scores.softmax(dim=-1) if sample else scores


def pick(distribution: torch.Tensor, sample: bool) -> torch.Tensor:
    """[1, 1]: a token drawn from the probabilities, or the argmax of the scores."""
    if sample:
        return torch.multinomial(distribution, 1)
    return distribution.argmax(dim=-1, keepdim=True)


def judge(guesses: torch.Tensor, p: torch.Tensor, q: list[torch.Tensor], sample: bool) -> tuple[int, torch.Tensor]:
    """(how many guesses are kept, the tokens that follow: those guesses and the target's own).

    p: [1, k + 1, vocab] the target's distributions at each guess and after the last; q: the draft's
    k distributions its guesses were drawn from. Greedy keeps a guess while it is the target's
    argmax. Sampling keeps guess x with probability min(1, p(x) / q(x)) and, at the first one
    rejected, draws from max(p - q, 0) renormalised: every token is then distributed as p alone.
    """
    k = guesses.shape[1]
    if not sample:
        own = p.argmax(dim=-1)  # [1, k + 1]
        agree = (own[0, :k] == guesses[0]).int()
        kept = int(agree.cumprod(0).sum())
        return kept, torch.cat([guesses[:, :kept], own[:, kept: kept + 1]], dim=1)
    for i in range(k):
        x = guesses[0, i]
        if torch.rand(()) * q[i][0, x] >= p[0, i, x]:  # rejected: u >= p(x) / q(x)
            leftover = (p[0, i] - q[i][0]).clamp_(min=0)
            total = leftover.sum()
            # p <= q everywhere only where p == q, which cannot reject; guard the rounding anyway
            fallback = torch.multinomial(leftover / total if total > 0 else p[0, i], 1)
            return i, torch.cat([guesses[:, :i], fallback[None]], dim=1)
    return k, torch.cat([guesses, torch.multinomial(p[0, k], 1)[None]], dim=1)


def keep(input_ids: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, stopping_criteria,
         streamer) -> tuple[torch.Tensor, bool]:
    """Appends tokens one at a time until a stopping criterion holds: (input_ids, whether it held).
    Criteria are checked after every token, so a round never runs past an end token or max_length."""
    finished = False
    count = 0
    for i in range(tokens.shape[1]):
        count += 1
        if bool(stopping_criteria(torch.cat([input_ids, tokens[:, : i + 1]], dim=1), scores[:, i]).all()):
            finished = True
            break
    input_ids = torch.cat([input_ids, tokens[:, :count]], dim=1)
    if streamer is not None:
        streamer.put(tokens[:, :count].cpu())
    return input_ids, finished


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per round when each of k guesses is kept with this probability, up to the first miss."""
    if acceptance >= 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)
