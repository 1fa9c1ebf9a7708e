"""Perplexity of a causal LM over a fixed English text that ships with Python, scored in windows
its context allows.

The text is pydoc's topic documentation (pydoc_data.topics): every topic in sorted key order,
joined by one blank line. It changes between Python versions, so a figure goes with the Python
that made it (tools/quality.py records the version and a digest of the ids it scored).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerolite.hf import cache_keyword

TOPIC_SEPARATOR = "\n\n"  # topics end without a newline; a blank line keeps them apart as paragraphs


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return TOPIC_SEPARATOR.join(topics[key] for key in sorted(topics))


def corpus_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first `tokens` ids of the text, tokenized as the tokenizer does by default (SmolLM2's
    adds no BOS)."""
    ids = tokenizer(corpus_text()).input_ids
    if len(ids) < tokens:
        raise ValueError(f"the text holds {len(ids)} tokens with this tokenizer, fewer than the {tokens} asked for")
    return torch.tensor(ids[:tokens])


@dataclass(frozen=True)
class Score:
    nll_sum: float  # nats, over every predicted token
    predicted: int  # every token but the first

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.predicted

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def context_window(config) -> int | None:
    """The positions the model has (None for ALiBi models such as BLOOM, which have no limit)."""
    return getattr(config, "max_position_embeddings", None)


def windows(length: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first) per window: the tokens begin..end-1 go through the model, and the
    predictions of tokens first..end-1 count. Windows start every `stride` tokens, and each token
    counts once, in the first window that holds it, so that every token past the first window
    has at least window - stride tokens of context."""
    if not 0 < stride < window:
        raise ValueError(f"the stride ({stride}) must be positive and shorter than the window ({window})")
    begin, first = 0, 1  # the very first token has no context: it is never predicted
    while first < length:
        end = min(begin + window, length)
        yield begin, end, first
        begin, first = begin + stride, end


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, stride: int | None = None, progress=None) -> Score:
    """model's perplexity on the 1-D tensor ids, by its own forward, in windows of its context
    (stride: half a window unless given). progress, if given, advances by the tokens scored."""
    window = context_window(model.config) or len(ids)
    stride = stride or window // 2
    nll_sum = 0.0
    for begin, end, first in windows(len(ids), window, stride):
        logits = model(input_ids=ids[None, begin:end], use_cache=False).logits[0]
        # The logit at position p predicts token p + 1; the loss is taken in fp32 whatever the compute dtype.
        predicted = logits[first - begin - 1 : -1].float()
        nll_sum += F.cross_entropy(predicted, ids[first:end], reduction="sum").item()
        if progress is not None:
            progress.advance(end - first)
    return Score(nll_sum, len(ids) - 1)


@torch.no_grad()
def perplexity_through_cache(model, ids: torch.Tensor, new_cache, chunk: int, progress=None) -> Score:
    """The same score, the text fed chunk tokens at a time through a K/V cache (new_cache() makes
    one per window), so that every prediction attends to the K/V of the tokens before it as the
    cache gives them back: quantized K/V (--kv-bits) is then read as decoding reads it. A cache that
    quantizes each token alone (zerolite.quant.kv_codec at 8 bits) gives the same K/V whatever the
    chunk; one that stores keys in groups of tokens (4 bits) does so for chunks that divide the group,
    the windows starting on a group's first token. Then this is token-by-token decoding's score, up
    to the rounding of the matmuls' shapes."""
    window = context_window(model.config) or len(ids)
    nll_sum = 0.0
    for begin, end, first in windows(len(ids), window, window // 2):
        cache, logits = new_cache(), []
        for start in range(begin, end, chunk):
            stop = min(start + chunk, end)
            out = model(input_ids=ids[None, start:stop], use_cache=True, **{cache_keyword(): cache})
            logits.append(out.logits[0].float())
            if progress is not None:
                progress.advance(max(stop - max(start, first), 0))
        predicted = torch.cat(logits)[first - begin - 1 : -1]
        nll_sum += F.cross_entropy(predicted, ids[first:end], reduction="sum").item()
    return Score(nll_sum, len(ids) - 1)
