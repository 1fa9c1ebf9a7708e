"""The K/V cache, partly in host memory: a transformers Cache whose chosen layers keep their keys and
values on the host between uses (pinned on CUDA), so the batch can grow past device memory.

    cache = PartialOffloadCache(model.config, fraction=0.5, device=torch.device("cuda"))
    model.generate(**batch, past_key_values=cache)

An offloaded layer's K/V are copied to the device one layer ahead of use, on a stream of their
own, and each step's new keys and values are appended to the host copy in place (its buffer grows
by doubling), so a step moves the layer's K/V in once and only the new tokens out. The attention
code sees exactly the tensors a DynamicCache would give it: the outputs are the same token for token.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

MIN_TOKENS = 256  # the first host buffer's length: appends then rarely reallocate


class HostLayer(DynamicLayer):
    """One layer's K/V in host memory; update() hands the attention device tensors, as DynamicLayer does."""

    def __init__(self, stream: torch.cuda.Stream | None):
        super().__init__()
        self.stream = stream          # the host-to-device copies' stream on CUDA; None on a CPU device
        self._fetched = None          # (keys, values, ready event) brought to the device ahead of use
        self._buffers = None          # (keys, values) host buffers with room to grow along the sequence

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.empty((*key_states.shape[:-2], 0, key_states.shape[-1]), dtype=self.dtype)
        self.values = torch.empty((*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=self.dtype)
        self.is_initialized = True

    def prefetch(self) -> None:
        """Starts bringing the K/V to the device (nothing to move on a CPU device)."""
        if not self.is_initialized or self._fetched is not None:
            return
        if self.device.type != "cuda":
            self._fetched = (self.keys, self.values, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the last appends have landed on the host
        with torch.cuda.stream(self.stream):
            keys = self.keys.to(self.device, non_blocking=True)
            values = self.values.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self._fetched = (keys, values, ready)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.prefetch()  # a no-op when the cache already fetched this layer one layer ahead
        keys, values, ready = self._fetched
        self._fetched = None
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            keys.record_stream(current)  # made on the copy stream, used and freed on this one
            values.record_stream(current)
        self._append(key_states, value_states)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        length, extra = self.keys.shape[-2], key_states.shape[-2]
        if not self._has_room(length + extra):
            self._grow(length + extra)
        keys, values = self._buffers
        keys[..., length:length + extra, :].copy_(key_states, non_blocking=True)
        values[..., length:length + extra, :].copy_(value_states, non_blocking=True)
        self.keys, self.values = keys[..., :length + extra, :], values[..., :length + extra, :]

    def _has_room(self, length: int) -> bool:
        """Whether the host buffers hold length tokens and self.keys is still their prefix (a crop
        keeps it one; a batch reorder makes a new tensor)."""
        if self._buffers is None:
            return False
        keys = self._buffers[0]
        return (keys.shape[-2] >= length and keys.data_ptr() == self.keys.data_ptr()
                and keys.shape[:-2] == self.keys.shape[:-2])

    def _grow(self, length: int) -> None:
        self._settle()
        pinned = self.device.type == "cuda"
        capacity = max(2 * length, MIN_TOKENS)
        grown = []
        for old in (self.keys, self.values):
            buffer = torch.empty((*old.shape[:-2], capacity, old.shape[-1]), dtype=self.dtype, pin_memory=pinned)
            buffer[..., :old.shape[-2], :].copy_(old)
            grown.append(buffer)
        self._buffers = tuple(grown)
        self.keys, self.values = grown[0][..., :self.keys.shape[-2], :], grown[1][..., :self.values.shape[-2], :]

    def _settle(self) -> None:
        """Waits for appends still on their way to the host, before the host copy is read there."""
        self._fetched = None
        if self.is_initialized and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def crop(self, tokens_to_remove: int) -> None:
        self._settle()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._settle()
        super().reorder_cache(beam_idx.cpu())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._settle()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._settle()
        super().batch_select_indices(indices.cpu())


class PartialOffloadCache(DynamicCache):
    """A DynamicCache with a fraction of its full-attention layers in host memory, spread evenly."""

    def __init__(self, config: PretrainedConfig, fraction: float, device: torch.device):
        super().__init__(config=config)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        eligible = [i for i, layer in enumerate(self.layers) if type(layer) is DynamicLayer]
        for i in spread(eligible, round(fraction * len(eligible))):
            self.layers[i] = HostLayer(stream)

    @property
    def offloaded(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, HostLayer)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        following = self.layers[(layer_idx + 1) % len(self.layers)]
        if isinstance(following, HostLayer):
            following.prefetch()  # one layer ahead: its copy runs while this layer's attention does
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of K/V one token adds to the cache, over all layers."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def spread(items: list, count: int) -> list:
    """count of items, evenly spaced over the list (all of them when count reaches its length):
    each offloaded layer then follows one that is not, whose attention hides its copy."""
    count = max(min(count, len(items)), 0)
    return [items[(2 * j + 1) * len(items) // (2 * count)] for j in range(count)]
