"""Micro-batches (--micro-batches N): one pass over the weights serves a batch N times larger than
the device holds the activations of, as FlexGen's block schedule does. Each decoder layer, once its
weights are bound, runs every micro-batch (a share of the batch's rows, the prefill's whole prompts
included) before the executor drops it for the next layer:

    cache = MicroBatchCache([lm.new_cache(tokens) for _ in range(4)])  # one cache per micro-batch
    handle = MicroBatched(model, layer_modules, micro_batches=4)        # the layers' forwards split
    model.generate(..., cache=cache)
    handle.remove()

The device then holds the activations of one micro-batch at a time (a layer's projections, the
MLP's intermediates and the attention scores, the widest of a run); what every row keeps through
the pass (the hidden states between layers, the last position's logits) and the K/V are the whole
batch's, wherever the policy puts them.

Nothing here knows an architecture. A layer's arguments are split by rows: every tensor of two or
more dimensions whose first is the batch (or a multiple of it, batch-major: Bloom's alibi is batch
x heads), inside tuples and dicts too; tensors with a first dimension of 1 broadcast and pass
whole, as do 1-D ones (cache positions) and everything else. Each micro-batch gets its own cache,
made by whatever makes the model's caches (any tier, any bits), since transformers' caches grow
along the sequence, not the batch; the outputs are joined again along the rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.cache_utils import Cache

from zerolite.errors import ZeroliteError


class MicroBatchCache(Cache):
    """The cache generate holds for a batch run in micro-batches: one cache per micro-batch, rows in
    order. What the model asks of it outside its layers (lengths, mask sizes) the first part answers:
    every part holds the same positions of its own rows. Its layers hand each micro-batch its part."""

    def __init__(self, parts: list[Cache]):
        super().__init__(layers=parts[0].layers)
        self.parts = parts

    def update(self, *args, **kwargs):
        raise ZeroliteError("a micro-batched cache was updated with the whole batch: a decoder layer ran outside "
                            "zerolite's micro-batches")

    update_conv_state = update_recurrent_state = update_indexer = update

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def crop(self, tokens_to_remove: int) -> None:
        for part in self.parts:
            part.crop(tokens_to_remove)

    def activate_past_recording(self) -> None:
        for part in self.parts:
            part.activate_past_recording()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ZeroliteError("beam search reorders rows across micro-batches: use `micro_batches` 1 with num_beams")

    batch_repeat_interleave = batch_select_indices = reorder_cache

    def wait_for_copies(self) -> None:
        """Each part's copies still in flight (its K/V in host memory), as the caller's cache waits for its own."""
        for part in self.parts:
            if hasattr(part, "wait_for_copies"):
                part.wait_for_copies()

    def return_host_buffers(self) -> None:
        """Each part's host buffers back to the pool the model's caches share."""
        for part in self.parts:
            if hasattr(part, "return_host_buffers"):
                part.return_host_buffers()


def row_ranges(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """The rows of each micro-batch, in order: as even as whole rows allow, never an empty one."""
    count = min(batch, micro_batches)
    bounds = [batch * i // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def rows_of(value, start: int, stop: int, batch: int, part: int):
    """value (a layer's argument) as micro-batch part (rows start to stop of batch) sees it."""
    if isinstance(value, MicroBatchCache):
        return value.parts[part]
    if isinstance(value, torch.Tensor):
        if value.dim() < 2 or value.shape[0] % batch or value.shape[0] == 0:
            return value
        per_row = value.shape[0] // batch
        return value[start * per_row:stop * per_row]
    if isinstance(value, (tuple, list)):
        return type(value)(rows_of(item, start, stop, batch, part) for item in value)
    if isinstance(value, dict):
        return {key: rows_of(item, start, stop, batch, part) for key, item in value.items()}
    return value


def joined(outputs: list, cache: MicroBatchCache | None):
    """The micro-batches' outputs of one layer as the whole batch's: tensors joined along the rows,
    a part's cache returned as the whole cache, what every part returns alike (None) as it is."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=0) if len(outputs) > 1 else first
    if isinstance(first, (tuple, list)):
        return type(first)(joined(list(items), cache) for items in zip(*outputs, strict=True))
    if cache is not None and first is cache.parts[0]:
        return cache
    if any(output is not first for output in outputs):
        raise ZeroliteError(f"a decoder layer returned a {type(first).__name__} that micro-batches cannot join: "
                            "use `micro_batches` 1")
    return first


def micro_batched(forward, micro_batches: int):
    """forward (a decoder layer's own) run once per micro-batch of its hidden states' rows. A call
    whose cache is not a MicroBatchCache (a caller's own, or the running batch's: one cache over
    every row) runs whole, as its cache's rows cannot be split."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        batch = hidden.shape[0]
        caches = [value for value in (*args, *kwargs.values()) if isinstance(value, Cache)]
        cache = caches[0] if caches else None
        if cache is not None and not isinstance(cache, MicroBatchCache):
            return forward(*args, **kwargs)
        outputs = []
        for part, (start, stop) in enumerate(row_ranges(batch, micro_batches)):
            outputs.append(forward(*rows_of(args, start, stop, batch, part),
                                   **rows_of(kwargs, start, stop, batch, part)))
        return joined(outputs, cache)

    return run


class MicroBatched:
    """A hook-like handle: while it lasts, each of layers runs its forward in micro-batches (its
    hooks, the executor's binding among them, still run once per call: one load serves them all)."""

    def __init__(self, layers: list[nn.Module], micro_batches: int):
        self.layers = layers
        for layer in layers:
            layer.forward = micro_batched(layer.forward, micro_batches)

    def remove(self) -> None:
        for layer in self.layers:
            del layer.forward  # the class's own again
