"""What several test files do alike: greedy generation (on a transformers model or a zerolite
LM), left-padded batches, and zerolite generate's command line and output file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

PAD = 0  # the tiny models' pad token


def left_padded(rows: list[list[int]], pad: int = PAD) -> dict[str, torch.Tensor]:
    """Prompts of different lengths as one batch: input_ids padded on the left, and their attention mask."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def greedy(model_or_lm, prompts: torch.Tensor | list[list[int]], new_tokens: int, *, exact: bool = False,
           logits: bool = False, device: str = "cpu", **more):
    """generate() decoding greedily, with the tiny models' pad token.

    prompts: a tensor of token ids, or rows of ids of any lengths (then left-padded, with their
    attention mask). exact: exactly new_tokens tokens, an end token notwithstanding (otherwise up
    to new_tokens). logits: transformers' dict output, each step's logits in it (otherwise the
    sequences). device: where the inputs are put. more: generate's other arguments (an
    attention_mask beside a tensor of ids, eos_token_id, a cache, ...)."""
    inputs = left_padded(prompts) if isinstance(prompts, list) else {"input_ids": prompts}
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    if exact:
        more["min_new_tokens"] = new_tokens
    if logits:
        more.update(output_logits=True, return_dict_in_generate=True)
    return model_or_lm.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, **more)


def new_tokens_alone(model_or_lm, prompt: list[int], new_tokens: int, **more) -> list[int]:
    """The tokens greedy decoding adds to one prompt on its own (batch 1, no padding)."""
    return greedy(model_or_lm, torch.tensor([prompt]), new_tokens, **more)[0, len(prompt):].tolist()


def generate_args(layout, prompts, output, *more: str, batch: int, new_tokens: int) -> list[str]:
    """zerolite generate's arguments (after the program's name): a file of prompts to a file of
    completions on the CPU, in batches of batch, with more options after them."""
    return ["generate", "--model", str(layout), "--input", str(prompts), "--output", str(output), "--batch-size",
            str(batch), "--max-new-tokens", str(new_tokens), "--device", "cpu", *more]


def lines_by_id(output: Path, parsed: bool = False) -> dict:
    """A completions file's lines by their prompt's id, each id there once; parsed: each line as
    its JSON object (otherwise as written)."""
    lines = output.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    ids = [record["id"] for record in records]
    assert len(ids) == len(set(ids)), "an id written twice"
    return dict(zip(ids, records if parsed else lines))
