"""The running batch of a server: sequences at different places in their lives share each forward,
so that one pass over the streamed weights serves all of them.

    batch = RunningBatch(lm, step_tokens=512)
    batch.add([Row(prompt_ids, owner=sequence)])
    for row, logits in batch.step():     # rows whose prompt is all in the cache: their next token's logits
        row.pending = [choose(logits)]
    batch.remove(finished_rows)

The K/V cache stays as transformers' generate keeps a left-padded batch: row r's fed tokens fill
the last fed_r columns of every layer, the columns before them are masked. A step appends a chunk
of T columns, in which every row feeds its next tokens right-aligned: a decoding row its one
sampled token, a row still prefilling up to T tokens of its prompt. A row that feeds fewer than T
leaves holes, masked, between its history and its new tokens; after the forward they are moved to
the front of its columns, and the columns masked in every row are dropped, so the invariant holds
again and the cache is never wider than the longest sequence. Positions come from the mask, as
generate derives them, so a row's tokens are the ones generate gives its prompt alone.

Only decoding rows are ever padded, and only in the steps that carry a prompt: T is bounded by
step_tokens over the batch, so a long prompt is fed over several steps (chunked prefill) instead
of stalling every other row behind one wide forward.

Why not transformers' continuous batching (generate_batch, init_continuous_batching): it packs the
batch into one ragged row for paged attention, which only models on transformers' attention
interface have (not BLOOM, whose ALiBi attention is its own); its PagedAttentionCache is sized on
model.device, which is meta for streamed weights, and takes the place of zerolite's K/V offload.
A left-padded batch runs the model's own forward, mask and positions, on every architecture.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from zerolite.errors import ZeroliteError
from zerolite.hf import cache_keyword
from zerolite.runtime.kv_cache import PartialOffloadCache
from zerolite.text import pad_id


@dataclass(eq=False)
class Row:
    pending: list[int]               # tokens still to feed: the prompt's rest, then the last one chosen
    owner: object = None             # whatever the caller tracks the row by (the decode loop's Sequence)
    fed: int = field(default=0, init=False)  # tokens already in the cache


class RunningBatch:
    def __init__(self, lm, step_tokens: int):
        """lm: a loaded OffloadedLM. step_tokens: the most tokens one forward computes, over all rows."""
        self.lm = lm
        self.model = lm.model
        self.step_tokens = max(step_tokens, 1)
        self.rows: list[Row] = []
        self.cache = None
        self.computed = 0             # tokens the last step computed over all rows, the padding included
        if lm.policy.micro_batches > 1:
            raise ZeroliteError(MICRO_BATCHES_SPLIT_STATIC)
        forward = inspect.signature(self.model.forward).parameters
        if cache_keyword() not in forward:
            raise ZeroliteError(STATE_OF_ITS_OWN)
        self._takes_positions = "position_ids" in forward
        self._keeps_logits = "logits_to_keep" in forward
        self.max_columns = cache_columns_limit(lm.new_cache())
        # a masked column's: embedded, never attended to
        self.pad_id = pad_id(lm.tokenizer, self.model.generation_config)

    @property
    def width(self) -> int:
        """Columns every layer's K/V holds: the longest row's fed tokens."""
        return max((row.fed for row in self.rows), default=0)

    def add(self, rows: list[Row]) -> None:
        """Rows join with nothing fed: masked columns under the others' history."""
        if not rows:
            return
        if not self.rows:
            self.cache = self.lm.new_cache()
        self.rows += rows
        self._each_layer(lambda states: torch.cat([states, states.new_zeros((len(rows), *states.shape[1:]))]))

    def remove(self, rows: list[Row]) -> None:
        """Rows leave; the columns only they used go with them."""
        leaving = set(map(id, rows))
        keep = [i for i, row in enumerate(self.rows) if id(row) not in leaving]
        if len(keep) == len(self.rows):
            return
        before = self.width
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.reset()
            return
        index = torch.tensor(keep)
        drop = before - self.width
        self._each_layer(lambda states: states.index_select(0, index.to(states.device))[:, :, drop:])

    def merge(self, other: RunningBatch) -> None:
        """other's rows join this batch with the K/V they have fed, and other is left empty: the
        narrower batch's columns are padded on the left, masked, so that each row's fed tokens stay
        the last columns of its own (a prompt prefilled apart, then decoded with the others)."""
        if not other.rows:
            return
        if not self.rows:
            self.rows, self.cache, other.rows, other.cache = other.rows, other.cache, [], None
            return
        width = max(self.width, other.width)

        def widened(states, columns):
            return torch.cat([states.new_zeros((*states.shape[:2], columns - states.shape[2], *states.shape[3:])),
                              states], dim=2)

        with torch.no_grad():
            for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
                if hasattr(mine, "wait_for_copies"):
                    mine.wait_for_copies()  # a host layer: its copies in flight land before its tensors change
                    theirs.wait_for_copies()
                if getattr(mine, "group", 1) > 1:  # K/V stored a group of tokens at a time: joined as states
                    mine.restore(*(torch.cat([widened(own, width), widened(joining, width).to(own.device)])
                                   for own, joining in zip(mine.states(), theirs.states())))
                    continue
                mine.keys = torch.cat([widened(mine.keys, width), widened(theirs.keys, width).to(mine.keys.device)])
                mine.values = torch.cat([widened(mine.values, width),
                                         widened(theirs.values, width).to(mine.values.device)])
                if hasattr(mine, "cumulative_length"):
                    mine.cumulative_length = mine.keys.shape[-2]
        self.rows += other.rows
        other.reset()

    def reset(self) -> None:
        """Drops every row (after a failed forward, the cache is not to be trusted)."""
        if isinstance(self.cache, PartialOffloadCache):
            self.cache.return_host_buffers()  # its host buffers serve the next
        self.rows = []
        self.cache = None

    def step(self) -> list[tuple[Row, torch.Tensor]]:
        """One forward over every row: the rows whose pending tokens are now all fed, each with
        the fp32 logits of its next token (on the host). A row given back must get its next token in pending
        before the next step; the others carry on prefilling."""
        if not self.rows:
            return []
        width = self.width
        chunk = min(max(len(row.pending) for row in self.rows), max(self.step_tokens // len(self.rows), 1))
        if self.max_columns is not None:
            chunk = max(min(chunk, self.max_columns - width), 1)
        feeds = [min(len(row.pending), chunk) for row in self.rows]
        self.computed = chunk * len(self.rows)
        device = self.lm.torch_device
        ids = torch.full((len(self.rows), chunk), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(self.rows), width + chunk), dtype=torch.long)
        positions = torch.zeros((len(self.rows), chunk), dtype=torch.long)
        for r, (row, feed) in enumerate(zip(self.rows, feeds)):
            ids[r, chunk - feed:] = torch.tensor(row.pending[:feed])
            mask[r, width - row.fed:width] = 1
            mask[r, width + chunk - feed:] = 1
            positions[r, chunk - feed:] = torch.arange(row.fed, row.fed + feed)
        extra = {"logits_to_keep": 1} if self._keeps_logits else {}
        if self._takes_positions:
            extra["position_ids"] = positions.to(device)
        inputs = self.model.prepare_inputs_for_generation(
            ids.to(device), next_sequence_length=chunk, **{cache_keyword(): self.cache},
            # all ones is left out, as generate leaves it out, for the attention's unmasked path
            attention_mask=None if bool(mask.all()) else mask.to(device), use_cache=True, **extra)
        with torch.no_grad():  # as generate: K/V made here are changed in place later, which inference mode forbids
            try:
                logits = self.model(**inputs).logits[:, -1, :].float().cpu()  # one copy for every row's choice
            except BaseException:
                self.lm.recover()
                raise
        self._close_holes(width, chunk, feeds)
        done = []
        for r, (row, feed) in enumerate(zip(self.rows, feeds)):
            row.fed += feed
            del row.pending[:feed]
            if not row.pending:
                done.append((row, logits[r]))
        drop = width + chunk - self.width
        if drop:
            self._each_layer(lambda states: states[:, :, drop:])
        return done

    def _close_holes(self, width: int, chunk: int, feeds: list[int]) -> None:
        """Moves each row's holes (the chunk's columns it did not feed) to the front of its
        columns, where the next crop drops them. Rows that fed alike share one permutation."""
        for feed in sorted(set(feeds)):
            if feed == chunk:
                continue
            rows = torch.tensor([r for r, f in enumerate(feeds) if f == feed])
            holes = chunk - feed
            order = torch.cat([torch.arange(width, width + holes), torch.arange(width),
                               torch.arange(width + holes, width + chunk)])

            def reorder(states, rows=rows, order=order):
                rows, order = rows.to(states.device), order.to(states.device)  # a host layer's are on the host
                states[rows] = states[rows].index_select(2, order)  # in place: a host layer's buffers stay its own
                return states

            self._each_layer(reorder)

    def _each_layer(self, change) -> None:
        """Applies change to every cache layer's keys and values ([batch, heads, columns, dim])."""
        if self.cache is None:
            return
        with torch.no_grad():
            for layer in self.cache.layers:
                if not layer.is_initialized:
                    continue
                if hasattr(layer, "wait_for_copies"):
                    layer.wait_for_copies()  # a host layer: its copies in flight land before its tensors change
                if hasattr(layer, "change_states"):
                    layer.change_states(change)  # quantized K/V: their rows, or their states where stored in groups
                else:
                    layer.keys, layer.values = change(layer.keys), change(layer.values)
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = layer.keys.shape[-2]  # a sliding window's own count of tokens seen


# Micro-batches give each a cache of its own, made at the prefill; the running batch's rows join and
# leave one cache, which its micro-batches would have to share.
MICRO_BATCHES_SPLIT_STATIC = ("`micro_batches` splits a batch that starts together (generate's static batches), not "
                              "a running batch whose rows join and leave: leave out `micro_batches`")
# RWKV's forward takes a `state` of its own, not a cache: what it would be handed, it would not use
STATE_OF_ITS_OWN = ("zerolite serve batches sequences by their K/V columns, and this model keeps a state of its own "
                    "instead of a cache: serve a model with attention layers only")


def cache_columns_limit(cache) -> int | None:
    """The most columns the batch may ever hold: a sliding-window layer keeps only its window,
    and the columns of a left-padded batch must all stay. None: no limit but the context's."""
    windows = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer):
            raise ZeroliteError(
                f"zerolite serve batches sequences by their K/V columns, and this model's cache has "
                f"{type(layer).__name__} layers, which hold other state: serve a model with attention layers only"
            )
        if getattr(layer, "sliding_window", None):
            windows.append(layer.sliding_window - 1)
    return min(windows) if windows else None
