"""How the next token is chosen: one value for both front ends. generate hands it to transformers
as a GenerationConfig; the server gives each sequence a TokenChoice made from it.

    sampling = Sampling(max_new_tokens=64, sample=True, temperature=0.7, top_p=0.9, seed=1)
    config = sampling.generation_config(lm.generation_config, pad_id)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from zerolite.errors import ZeroliteError


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    sample: bool = False            # greedy unless set
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0: every token (top_p alone narrows them)
    presence_penalty: float = 0.0   # the server's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # the server's: subtracted per time a token was generated
    seed: int | None = None         # generate: set before every batch, so a batch's tokens do not depend on the
                                    # ones before
    chat: bool = False              # generate: wrap each prompt in the tokenizer's chat template

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ZeroliteError(f"`max_new_tokens` must be at least 1, got {self.max_new_tokens}")
        if self.sample and not self.temperature > 0:
            raise ZeroliteError(f"`temperature` must be above 0, got {self.temperature}: "
                                "for greedy decoding leave out `sample`")
        if not 0 < self.top_p <= 1:
            raise ZeroliteError(f"`top_p` must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ZeroliteError(f"`top_k` must be 0 (all tokens) or more, got {self.top_k}")

    def generation_config(self, base, pad_id: int):
        """transformers' GenerationConfig for this sampling: base (the model's own) with these
        fields set, and pad_id where base names no pad token."""
        config = copy.deepcopy(base)
        config.max_new_tokens = self.max_new_tokens
        config.max_length = None
        config.do_sample = self.sample
        if self.sample:
            config.temperature, config.top_p, config.top_k = self.temperature, self.top_p, self.top_k
        if config.pad_token_id is None:
            config.pad_token_id = pad_id
        return config
