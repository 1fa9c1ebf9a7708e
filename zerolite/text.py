"""Prompts to token ids, and the model facts both front ends need: its context, its end and pad
ids. The checks raise PromptError, which each front end words its own way (generate names the
prompt and its --input line; the server answers 400 with the error's code).

    ids = encode_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    check_ids(ids, vocab_size=config.vocab_size)       # PromptError(code="invalid_token_id")
    limit = context_length(config)
"""

from __future__ import annotations

import torch

from zerolite.errors import ZeroliteError

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")


class PromptError(ZeroliteError):
    """A prompt the model cannot take. code names the problem as OpenAI's API does
    (empty_prompt, invalid_token_id, no_tokenizer, no_chat_template, chat_template_refused)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def encode_text(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise PromptError("this model has no tokenizer: give the prompt as token ids", "no_tokenizer")
    return tokenizer(text).input_ids


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The messages in the tokenizer's chat template, ready for the assistant's answer."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template", "no_chat_template")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (roles that must alternate, ...) raise
        raise PromptError(f"the model's chat template refused these messages: {' '.join(str(e).split())}",
                          "chat_template_refused") from None
    return tokenizer(text, add_special_tokens=False).input_ids  # the template has its special tokens


def check_ids(ids, vocab_size: int) -> None:
    """Some tokens, each an id the model has."""
    if not len(ids):
        raise PromptError("the prompt holds no tokens", "empty_prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"the prompt holds token id {bad}, but the model's vocabulary has ids 0 to {vocab_size - 1}",
                          "invalid_token_id")


def check_token_ids(config, input_ids) -> None:
    """check_ids for a tensor of ids, on the host: on a GPU an id past the vocabulary would be a
    device-side assert, which poisons the CUDA context, and the recovery would then raise a second
    error that hides the first."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.numel() == 0:
        return
    try:
        check_ids((int(input_ids.min()), int(input_ids.max())), config.get_text_config().vocab_size)
    except PromptError as e:
        raise ZeroliteError(f"`input_ids`: {e}: check the prompt's ids") from None


def context_length(config) -> int | None:
    """Tokens per sequence the model was made for, prompt and completion together; None where its
    config names none (BLOOM's ALiBi)."""
    config = config.get_text_config()
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def end_token_ids(generation_config) -> frozenset[int]:
    """The generation config's end-of-sequence ids (one id, a list, or none)."""
    eos = generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [eos]) - {None}


def pad_id(tokenizer, generation_config) -> int:
    """The tokenizer's pad id, else the end-of-sequence id, else 0."""
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    eos = generation_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if eos is not None else 0


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for rows padded on the left, as decoder-only generation needs."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, ids in enumerate(rows):
        input_ids[k, width - len(ids) :] = torch.tensor(ids)
        attention_mask[k, width - len(ids) :] = 1
    return input_ids, attention_mask
