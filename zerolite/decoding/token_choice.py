"""How one sequence picks its next token from the logits, as the OpenAI API's parameters say:
greedy at temperature 0, else sampled after presence and frequency penalties, temperature, top-k
and top-p (transformers' own warpers), from a generator of the sequence's own, so that a seed gives
the same tokens whatever else shares the batch.

    choice = TokenChoice(Sampling(sample=True, temperature=0.7, top_p=0.9, seed=1), vocab_size=32000)
    token = choice.pick(logits)    # fp32 logits of one row
"""

from __future__ import annotations

import secrets

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from zerolite.sampling import Sampling

SEEDS = 2**64         # torch's generators take seeds modulo this


class TokenChoice:
    def __init__(self, sampling: Sampling, vocab_size: int):
        self.sampling = sampling
        self.counts = torch.zeros(vocab_size) if sampling.presence_penalty or sampling.frequency_penalty else None
        self.generator = None
        self.warpers = []
        if sampling.sample:
            seed = sampling.seed % SEEDS if sampling.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(seed)
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                self.warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(sampling.top_p))

    def pick(self, logits: torch.Tensor) -> int:
        scores = logits.detach().to("cpu", torch.float32).clone()
        if self.counts is not None:
            scores = scores[: self.counts.numel()]  # a head padded past the vocabulary
            scores -= self.sampling.frequency_penalty * self.counts + self.sampling.presence_penalty * (self.counts > 0)
        if self.generator is None:
            token = int(scores.argmax())
        else:
            scores = scores[None]
            for warper in self.warpers:
                scores = warper(None, scores)
            token = int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator))
        if self.counts is not None:
            self.counts[token] += 1
        return token


# generation-config fields whose logits processors transformers' generate adds and TokenChoice does not
# apply, each with the value that adds none (GenerationMixin._get_logits_processor)
NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0,
           "min_new_tokens": 0, "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None,
           "begin_suppress_tokens": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
           "guidance_scale": 1.0}
NEUTRAL_SAMPLING = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


def rules_beyond_choice(generation_config) -> list[str]:
    """The fields of a model's generation config that would make transformers' generate choose
    other tokens than TokenChoice: the processors it adds for them."""
    neutral = {**NEUTRAL, **(NEUTRAL_SAMPLING if generation_config.do_sample else {})}
    return [name for name, value in neutral.items() if getattr(generation_config, name, value) not in (value, None)]
