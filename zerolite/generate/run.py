"""The generate job: prompts in batches through a loaded model, completions and timings out.

    stats = generate_all(lm, prompts, Sampling(max_new_tokens=64), batch_size=8, on_batch=write)

Prompts are batched in input order and left-padded with an attention mask, as transformers
expects for decoder-only models; every batch is one transformers generate call.
"""

from __future__ import annotations

import copy
import resource
from collections.abc import Callable

import torch

from zerolite.errors import ZeroliteError
from zerolite.generate.prompts import Completion, Prompt
from zerolite.generate.stats import RunStats, StepClock
from zerolite.lm import OffloadedLM
from zerolite.progress import token_progress
from zerolite.runtime.batching import decide_batch_size, largest_batch
from zerolite.sampling import Sampling
from zerolite.text import (
    PromptError,
    check_ids,
    context_length,
    encode_chat,
    encode_text,
    end_token_ids,
    left_pad,
    pad_id,
)


def generate_all(
    lm: OffloadedLM,
    prompts: list[Prompt],
    sampling: Sampling,
    batch_size: int | None,
    on_batch: Callable[[list[Completion]], None],
    show_progress: bool = True,
    done: set = frozenset(),
    on_start: Callable[[int, int], None] = lambda batch_size, tokens: None,
    planned_batch: int | None = None,
) -> RunStats:
    """Generates for every prompt, batch after batch, handing each batch's completions to on_batch.

    batch_size None picks the largest batch the memory holds, at most planned_batch (decide_batch_size).
    Batches are cut from the whole list by position, so that a batch always holds the same prompts
    (and so gives the same tokens); those whose ids are all in done (a resumed run) are skipped.
    on_start hears the rows of the largest batch that runs (fewer than batch_size when fewer
    prompts are left) and the longest sequence among them, once the prompts are checked and before
    anything runs (if anything does).
    The engine, the slots and the resident blocks stay warm from one batch to the next.

    Under torchrun (lm.world) every rank calls this alike, with rank 0's prompts and done: the
    batches left are dealt out in rounds, batch r * ranks + rank to each rank, and after every
    round rank 0 alone hands all of its batches to on_batch, in input order, and shows the
    progress; it returns the totals over every rank (RunStats.across), the others their own.
    """
    world = lm.world
    encoded: list[list[int]] = []
    batches: list[range] = []

    def prepare() -> None:
        nonlocal encoded, batches
        if batch_size is not None and batch_size < 1:
            raise ZeroliteError(f"`batch_size` must be at least 1, got {batch_size}")
        encoded = encode(lm, prompts, sampling.chat)
        check_context(lm, prompts, encoded, sampling.max_new_tokens)

        def fits() -> int:  # the largest every rank's memory holds
            lengths = [len(ids) for ids in encoded]
            return min(world.all_gather(lambda: largest_batch(lm, lengths, sampling.max_new_tokens),
                                        "choosing the batch size"))

        size = decide_batch_size(batch_size, planned=planned_batch, fits=fits)
        batches = [range(start, min(start + size, len(prompts))) for start in range(0, len(prompts), size)]
        check_work(len(prompts), size, world.size)

    world.run_on_all(prepare, "preparing the prompts")
    batches = [rows for rows in batches if any(prompts[i].id not in done for i in rows)]
    running = [i for rows in batches for i in rows]
    if running:
        on_start(max(map(len, batches)), max(len(encoded[i]) for i in running) + sampling.max_new_tokens)
    config = sampling.generation_config(lm.generation_config, pad_id(lm.tokenizer, lm.generation_config))
    stats = RunStats(load_s=lm.load_s, convert_s=lm.convert_s)
    bytes_before = lm.bytes_read
    experts_before = lm.expert_counts()
    speculation_before = copy.copy(lm.speculator.stats) if lm.speculator is not None else None
    show_progress = show_progress and world.leads
    with token_progress("generating", len(running) * sampling.max_new_tokens, enabled=show_progress) as progress:
        for start in range(0, len(batches), world.size):
            deal = batches[start:start + world.size]
            progress.note(f"batch {start + 1}/{len(batches)}" if len(deal) == 1 else
                          f"batches {start + 1}-{start + len(deal)}/{len(batches)} on {world.size} ranks")

            # deal bound as a default: this iteration's batches, whatever the loop holds when all_gather calls it
            def run_mine(deal: list[range] = deal) -> tuple[list[Completion], int] | None:
                rows = deal[world.rank] if world.rank < len(deal) else None
                return run_batch(lm, prompts, encoded, rows, sampling, config, stats, progress) if rows else None

            for rank, result in enumerate(world.all_gather(run_mine, "generating")):
                if result is not None and world.leads:
                    completions, tokens = result
                    if rank != world.rank:
                        progress.advance(tokens)
                    on_batch(completions)
    stats.bytes_read = lm.bytes_read - bytes_before
    if lm.per_expert:
        stats.experts = lm.expert_counts().since(experts_before)
    if speculation_before is not None:
        stats.speculation = lm.speculator.stats.since(speculation_before)
    stats.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats.peak_device_bytes = lm.device.peak_allocated()
    if not world.distributed:
        return stats
    every = world.all_gather(lambda: stats, "adding up")
    return RunStats.across(every) if world.leads else stats


def check_work(prompts: int, batch_size: int, ranks: int) -> None:
    """Every rank must get a batch: torchrun's world is fixed, and an idle rank is a GPU wasted."""
    batches = -(-prompts // batch_size)
    if batches < ranks:
        raise ZeroliteError(f"{prompts} prompt{'s' if prompts != 1 else ''} in batches of {batch_size} make {batches} "
                            f"batch{'es' if batches != 1 else ''}, too few for {ranks} ranks: run {batches} "
                            f"rank{'s' if batches != 1 else ''} (torchrun --nproc-per-node), "
                            "or give a smaller `batch_size`")


def run_batch(lm: OffloadedLM, prompts: list[Prompt], encoded: list[list[int]], rows: range, sampling: Sampling, config,
              stats: RunStats, progress) -> tuple[list[Completion], int]:
    """One batch through one generate call: its completions, and the tokens its steps made."""
    input_ids, attention_mask = left_pad([encoded[i] for i in rows], config.pad_token_id)
    clock = StepClock(progress.advance)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    output = lm.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock)
    new = output[:, input_ids.shape[1] :].cpu()
    completions = [finish(lm, prompts[i], new[k].tolist(), config) for k, i in enumerate(rows)]
    stats.prefill_s += clock.prefill_s
    stats.decode_s += clock.decode_s
    stats.decode_tokens += clock.decode_tokens
    stats.decode_steps += clock.decode_steps
    stats.forwards += 1 + clock.decode_steps
    stats.new_tokens += sum(len(c.token_ids) for c in completions)
    return completions, sum(clock.tokens[1:])


# What a prompt that the model cannot take should do instead, by PromptError's code.
FIXES = {
    "no_tokenizer": 'give "input_ids" in the `input_file` instead',
    "no_chat_template": "leave out `chat`",
    "chat_template_refused": "leave out `chat`, or change the prompt",
    "empty_prompt": "give it some text",
    "invalid_token_id": "check its input_ids",
}


def encode(lm: OffloadedLM, prompts: list[Prompt], chat: bool) -> list[list[int]]:
    vocab = lm.config.get_text_config().vocab_size
    encoded = []
    for prompt in prompts:
        try:
            if prompt.input_ids is not None:
                ids = list(prompt.input_ids)
            elif chat:
                ids = encode_chat(lm.tokenizer, [{"role": "user", "content": prompt.text}])
            else:
                ids = encode_text(lm.tokenizer, prompt.text)
            check_ids(ids, vocab)
        except PromptError as e:
            raise ZeroliteError(f"{prompt.where}: {e}: {FIXES[e.code]}") from None
        encoded.append(ids)
    return encoded


def check_context(lm: OffloadedLM, prompts: list[Prompt], encoded: list[list[int]], max_new_tokens: int) -> None:
    limit = context_length(lm.config)
    if limit is None:
        return
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    length, where = len(encoded[longest]), prompts[longest].where
    if length > limit:
        raise ZeroliteError(f"{where} is {length} tokens, longer than the model's context of {limit}: shorten it")
    if length + max_new_tokens > limit:
        raise ZeroliteError(
            f"{where} is {length} tokens; with `max_new_tokens` {max_new_tokens} it would run past "
            f"the model's context of {limit}: use `max_new_tokens` {limit - length} or less"
        )


def finish(lm: OffloadedLM, prompt: Prompt, new_ids: list[int], config) -> Completion:
    """Cuts a row's new tokens after its first end-of-sequence token (generate pads the rest)."""
    eos_ids = end_token_ids(config)
    reason = "length"
    for k, token in enumerate(new_ids):
        if token in eos_ids:
            new_ids, reason = new_ids[: k + 1], "stop"
            break
    text = lm.tokenizer.decode(new_ids, skip_special_tokens=True) if lm.tokenizer is not None else None
    return Completion(prompt.id, prompt.text, text, new_ids, reason)
