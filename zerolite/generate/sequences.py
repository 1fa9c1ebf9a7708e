"""One prompt's generation as both batchings of generate see it: its Sequence (the running batch's
unit, with the prompt's own limit, stop strings and end tokens: the server's end rule) and, once
it ended, its Completion.

    sequence = sequence_for(lm, prompt, position, ids, sampling, eos_ids)
    text, reason = sequence.add(token)             # continuous: each token as it comes
    completion = replay(lm, prompt, sequence, new_ids)   # static: a row of generate's output, cut where it ends
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import StoppingCriteria

from zerolite.decoding.decoder import Sequence
from zerolite.decoding.text_stream import TextStream
from zerolite.decoding.token_choice import SEEDS, TokenChoice
from zerolite.generate.prompts import Completion, Prompt
from zerolite.sampling import Sampling


def sequence_for(lm, prompt: Prompt, position: int, ids: list[int], sampling: Sampling,
                 eos_ids: frozenset[int]) -> Sequence:
    """position: the prompt's place in the input, which seeds its sampling (sampling.seed +
    position), so that a seeded prompt gets the same tokens whatever shares its batch, resumed or not."""
    seed = None if sampling.seed is None else (sampling.seed + position) % SEEDS
    choice = TokenChoice(dataclasses.replace(sampling, seed=seed), lm.config.get_text_config().vocab_size)
    # the text is followed only where a stop string may end it: decoding every token costs a step's time
    text = TextStream(lm.tokenizer, list(prompt.stop)) if prompt.stop else None
    return Sequence(position, ids, max_tokens(prompt, sampling), choice, text, eos_ids)


def max_tokens(prompt: Prompt, sampling: Sampling) -> int:
    return prompt.max_new_tokens or sampling.max_new_tokens


def completion(lm, prompt: Prompt, sequence: Sequence, reason: str, shown: str) -> Completion:
    """shown: the text the sequence's TextStream let through (a stop string cut off), where it
    had one; otherwise the tokens are decoded whole, as generate always did."""
    if lm.tokenizer is None:
        text = None
    elif sequence.text is not None:
        text = shown
    else:
        text = lm.tokenizer.decode(sequence.generated, skip_special_tokens=True)
    return Completion(prompt.id, prompt.text, text, list(sequence.generated), reason)


def replay(lm, prompt: Prompt, sequence: Sequence, new_ids: list[int]) -> Completion:
    """A fresh sequence's completion from a row of a static batch's output: its tokens up to its
    end (the row goes on with pad tokens, or its neighbours' longer limits, after it)."""
    shown, reason = [], "length"
    for token in new_ids:
        text, ended = sequence.add(token)
        shown.append(text)
        if ended is not None:
            reason = ended
            break
    return completion(lm, prompt, sequence, reason, "".join(shown))


class RowsEnded(StoppingCriteria):
    """transformers' generate stops a row at the end its own Sequence finds (its own limit, a stop
    string), and the batch once every row ended, not at the longest limit in the batch."""

    def __init__(self, sequences: list[Sequence], prompt_width: int):
        self.sequences = sequences
        self.prompt_width = prompt_width
        self.ended = [False] * len(sequences)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        rows = input_ids[:, self.prompt_width:].tolist()
        for r, (sequence, tokens) in enumerate(zip(self.sequences, rows)):
            for token in tokens[len(sequence.generated):]:  # a draft's pass may bring several
                if self.ended[r]:
                    break
                self.ended[r] = sequence.add(token)[1] is not None
        return torch.tensor(self.ended, device=input_ids.device)
