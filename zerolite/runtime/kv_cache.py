"""The K/V cache, partly in host memory: a transformers Cache whose chosen layers keep their keys and
values on the host between uses (pinned on CUDA), so the batch can grow past device memory.

    cache = PartialOffloadCache(model.config, fraction=0.5, device=zerolite.io.device.resolve("cuda"))
    model.generate(**batch, **{zerolite.hf.cache_keyword(): cache})    # cache=, or past_key_values= up to 5.17

An offloaded layer's K/V are copied to the device one layer ahead of use, on a stream of their
own, and each step's new keys and values are appended to the host copy in place (its buffer made
at the job's length where generate knows it, else grown by doubling, and taken from a pool the
caches share, so pinning stays off the hot path) on another, so a step moves the layer's K/V in
once and only the new tokens out, and neither copy holds up compute (a long prefill's appends
would). A fetch waits for that layer's last appends and for the compute queued before it (its
targets come from compute's memory): it still runs while the layer before computes. The attention
code sees exactly the tensors a DynamicCache would give it: the outputs are the same token for token.

With bits 8 or 4 (--kv-bits) every attention layer's K/V, in every tier, is kept as
zerolite.quant.kv_codec packs it, with the same codecs: quantized as it is appended (at 4 bits the
keys a group of tokens at a time, the group being filled waiting at 8 bits where compute runs), the
layer's whole K/V dequantised when its attention reads it. The host copies then move the packed bytes.

A further share of the layers (--kv-disk) keeps its K/V in files under the offload root
(zerolite.runtime.kv_disk), read one layer ahead as the host layers are fetched; at 4 bits a group's
tokens are written once it fills, its keys packed per channel as on the device (the group being
filled waits where compute runs).
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from zerolite.io.device import Device
from zerolite.quant.kv_codec import KeyGroupCodec, KVCodec, kv_codecs
from zerolite.runtime.kv_disk import DiskLayer, KVDisk
from zerolite.runtime.plan import spread

MIN_TOKENS = 256  # the first host buffer's length: appends then rarely reallocate


class HostBufferPool:
    """Pinned host buffers for the K/V of the caches one executor makes. Pinning maps and registers
    memory with the GPU's driver, milliseconds per GB, so buffers a layer or a cache is done with
    come back here, and whatever is asked next takes the smallest that holds it, whatever shape it
    is viewed in: a batch that changes size (a server's rows joining and leaving) pins nothing while
    the pool holds enough. Only a request larger than every buffer here pins, and frees them first:
    every layer's buffers grow alike, so those are outgrown, and the pool never holds more than the
    last cache gave back."""

    def __init__(self, device: Device):
        self.device = device
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least nbytes."""
        fitting = [i for i, buffer in enumerate(self._free) if buffer.nbytes >= nbytes]
        if not fitting:
            self._free.clear()
            return self.device.pinned_empty(nbytes)
        return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))

    def give(self, *buffers: torch.Tensor) -> None:
        """Buffers no copy reads or writes any more (the caller waited for their copies)."""
        self._free += buffers


class OffloadedCaches:
    """What every K/V cache one model makes shares: the two streams their copies go on, (fetches,
    appends), since devices hand out streams from a small pool (None where memory is shared), and
    one pool of pinned host buffers."""

    def __init__(self, device: Device, disk: KVDisk | None = None):
        self.device = device
        self.streams = (device.new_stream(), device.new_stream()) if device.separate_memory else None
        self.pool = HostBufferPool(device)
        self.disk = disk  # where the layers kept on disk have their files (--kv-disk), None if none are

    def new(self, config: PretrainedConfig, fraction: float, tokens: int = 0, bits: int = 16,
            disk_fraction: float = 0.0) -> DynamicCache:
        """A cache for one job: with fraction > 0, that share of the layers' K/V in host memory,
        its buffers made for tokens (where the job's length is known), with disk_fraction > 0 that
        share on disk, and with bits < 16 the K/V quantized; else transformers' own."""
        if fraction > 0 or bits < 16 or disk_fraction > 0:
            return PartialOffloadCache(config, fraction, self.device, self.streams, self.pool, tokens, bits,
                                       self.disk, disk_fraction)
        return DynamicCache(config=config.get_text_config(decoder=True))

    def close(self) -> None:
        """Removes the K/V files' folder, with whatever files a cache still kept there."""
        if self.disk is not None:
            self.disk.close()


class HostLayer(DynamicLayer):
    """One layer's K/V in host memory; update() hands the attention device tensors, as DynamicLayer does.

    The host buffers are sequence-first, (capacity, batch, heads, head_dim), so that both the
    appended tokens and the prefix fetched each step are contiguous: pinned memory copies them
    asynchronously, where a strided slice would be staged through pageable memory and block.
    self.keys and self.values stay [batch, heads, length, head_dim] views of them, as transformers expects.
    """

    def __init__(self, host: Device, streams, pool: HostBufferPool, tokens: int = 0):
        super().__init__()
        self.host = host              # the zerolite Device: its streams, events and pinned memory
        self.pool = pool              # where the host buffers come from and go back to
        self.tokens = tokens          # the length the host buffers are first made for (the job's, if known)
        # (fetches, appends): the streams the host-to-device and device-to-host copies go on, so
        # that neither holds up compute; None where memory is shared
        self.fetches, self.appends = streams or (None, None)
        self._fetched = None          # (keys, values, ready event) brought to the device ahead of use
        self._buffers = None          # (keys, values) sequence-first host buffers with room to grow
        self._pinned = None           # the pool's flat buffers under them
        self._appended = None         # event: this layer's last appends have landed in the host buffers
        self._fetch_done = None       # event: the last fetch has finished reading the host buffers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.empty((*key_states.shape[:-2], 0, key_states.shape[-1]), dtype=self.dtype)
        self.values = torch.empty((*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=self.dtype)
        self.is_initialized = True

    def prefetch(self, extra: int = 0) -> None:
        """Starts bringing the K/V to the device (nothing to move where memory is shared). extra:
        the tokens this step appends, room for which is made now, before the fetch reads the
        buffers: growing them once it has would wait for it, in the middle of the forward."""
        if not self.is_initialized or self._fetched is not None:
            return
        if not self.host.separate_memory:
            self._fetched = (self.keys, self.values, None)
            return
        length = self.keys.shape[-2]
        if not self._has_room(length + extra):
            self._grow(length + extra)  # full, or a reordered or selected batch: sequence-first buffers anew
        if self._appended is not None:
            self.host.wait_event(self.fetches, self._appended)  # this layer's last appends have landed
        # The targets come from compute's memory, where they serve compute again once freed (memory
        # freed in another stream's pool can't, and mem_get_info does not count it); so the fetch
        # comes after the work compute queued before it took them.
        targets = [self.host.empty(buffer[:length].nbytes).view(self.dtype).view(buffer[:length].shape)
                   for buffer in self._buffers]
        self.host.wait_stream(self.fetches, self.host.compute_stream())
        for target, buffer in zip(targets, self._buffers):
            self.host.copy(target, buffer[:length], self.fetches)
        keys, values = (target.permute(1, 2, 0, 3) for target in targets)
        ready = self._fetch_done = self.host.record(self.fetches)
        self._fetched = (keys, values, ready)

    def stored_tokens(self, new: int) -> int:
        """How many tokens an update that brings new tokens appends to the host buffers."""
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.prefetch(key_states.shape[-2])  # a no-op when the cache already fetched this layer one layer ahead
        keys, values, ready = self._fetched
        self._fetched = None
        if ready is not None:
            compute = self.host.compute_stream()
            self.host.wait_event(compute, ready)
        self._append(key_states, value_states)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        length, extra = self.keys.shape[-2], key_states.shape[-2]
        if not self._has_room(length + extra):
            self._grow(length + extra)  # not where prefetch made room (a caller's own cache use): waits for the fetch
        self._copy_in(length, key_states, value_states)
        self.keys, self.values = (buffer[:length + extra].permute(1, 2, 0, 3) for buffer in self._buffers)

    def _copy_in(self, at: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The new tokens (where compute made them) copied into the host buffers from token at, on
        the appends stream."""
        stream = self.appends or self.host.compute_stream()
        if self.appends is not None:
            self.host.wait_stream(self.appends, self.host.compute_stream())  # the new keys and values are computed
        for buffer, states in zip(self._buffers, (key_states, value_states)):
            self.host.copy(buffer[at:at + states.shape[-2]], states.permute(2, 0, 1, 3), stream)
            self.host.keep_alive(states, stream)  # made by compute, read on the appends' stream
        self._appended = self.host.record(stream)

    def _has_room(self, length: int) -> bool:
        """Whether the host buffers hold length tokens and self.keys is still a view of their
        prefix (a crop keeps it one; a batch reorder or selection makes a new tensor)."""
        if self._buffers is None or self._buffers[0].shape[0] < length:
            return False
        view = self._buffers[0][: self.keys.shape[-2]].permute(1, 2, 0, 3)
        return (self.keys.data_ptr() == view.data_ptr() and self.keys.shape == view.shape
                and self.keys.stride() == view.stride())

    def _grow(self, length: int) -> None:
        """Lays the K/V out anew in sequence-first host buffers that hold length tokens:

        1. wait_for_copies: no copy still reads or writes the buffers (nothing is waited for where the
           running batch waited for the layer's copies to change it, at re-batching)
        2. the layer's own buffers where they hold length tokens at the batch's size now (rows
           joined or left): nothing pinned; else the pool's, with room for twice the tokens
        3. the tokens so far copied in, through a copy of their own where they lie in those buffers
        """
        self.wait_for_copies()
        used = self.keys.shape[-2]
        # keys and values may differ in width: DeepSeek-V3's attention caches its latent and its
        # rotary part as the two
        shapes = [(batch, heads, dim) for batch, heads, _, dim in (self.keys.shape, self.values.shape)]
        token_bytes = [math.prod(shape) * self.dtype.itemsize for shape in shapes]
        pinned = self._pinned
        if pinned is None or min(flat.nbytes // width for flat, width in zip(pinned, token_bytes)) < length:
            pinned = tuple(self.pool.take(max(2 * length, MIN_TOKENS, self.tokens) * width) for width in token_bytes)
        capacity = min(flat.nbytes // width for flat, width in zip(pinned, token_bytes))
        grown = []
        for flat, old, shape, width in zip(pinned, (self.keys, self.values), shapes, token_bytes):
            tokens = old.permute(2, 0, 1, 3)
            if old.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                tokens = tokens.clone()  # a view of the buffer itself (rows cropped in place): overlaps
            buffer = flat[:capacity * width].view(self.dtype).view(capacity, *shape)
            buffer[:used].copy_(tokens)
            grown.append(buffer)
        if self._pinned is not None and pinned is not self._pinned:
            self.pool.give(*self._pinned)
        self._buffers, self._pinned = tuple(grown), pinned
        self.keys, self.values = (buffer[:used].permute(1, 2, 0, 3) for buffer in grown)

    def wait_for_copies(self) -> None:
        """Waits for this layer's appends still on their way to the host, and for a fetch still
        reading the host buffers, before the host copy is read or replaced there; a fetch not yet
        used is dropped."""
        self._fetched = None
        for event in (self._appended, self._fetch_done):
            if event is not None:
                event.synchronize()
        self._appended = self._fetch_done = None  # seen: the next wait_for_copies waits for nothing

    def reset(self) -> None:
        """Empties the layer and hands its host buffers back to the pool."""
        self.wait_for_copies()
        if self._pinned is not None:
            self.pool.give(*self._pinned)
        self._buffers = self._pinned = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.wait_for_copies()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.wait_for_copies()
        super().reorder_cache(beam_idx.cpu())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.wait_for_copies()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.wait_for_copies()
        super().batch_select_indices(indices.cpu())


class QuantizedStates:
    """Put before a cache layer class: the layer keeps the K/V it is given packed by codecs (keys',
    values'; each token's head a row of uint8, its scales beside its codes), and hands attention the
    whole K/V decoded back into the states' dtype. The class after it stores, crops, selects and
    copies the packed rows as it would the states: it never sees anything else.

    Where the keys' codec packs a group of tokens at a time (4 bits), the tokens of the group not yet
    full wait in self.recent (their keys at the codec's waiting bits, their values packed), where
    compute runs (a layer attended on the host keeps them there: where_kept), and are stored
    together when it fills. Attention reads the stored keys decoded, then
    the waiting ones, this update's and those of a group it fills included: as decoding one token at
    a time reads them, so that a text fed a group at a time, aligned with the groups, reads the same
    K/V as decoding it does. What changes the tokens' columns (a running batch's rows joining,
    leaving, their holes moved) goes through change_states: decoded, changed, packed anew."""

    def __init__(self, *args, codecs: tuple[KVCodec | KeyGroupCodec, KVCodec], **kwargs):
        super().__init__(*args, **kwargs)
        self.codecs = codecs
        self.recent = None  # (keys, values) packed rows [batch, heads, < group, bytes] of the group not yet full

    @property
    def group(self) -> int:
        """The tokens packed together: 1 where every token is stored as it comes."""
        return self.codecs[0].tokens

    def stored_tokens(self, new: int) -> int:
        return (self.recent_length + new) // self.group * self.group

    @property
    def recent_length(self) -> int:
        return 0 if self.recent is None else self.recent[0].shape[-2]

    def packed_length(self) -> int:
        """The tokens stored packed, as the layer under counts them: a layer on disk need not read its file."""
        return super().get_seq_length()

    def where_kept(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This update's packed rows where the layer keeps what waits and decodes what attention
        reads: where compute made them (a layer attended on the host moves them there)."""
        return rows

    def get_seq_length(self) -> int:
        return super().get_seq_length() + self.recent_length  # a sliding window's: the tokens it has seen

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        (keys_codec, values_codec), dtype = self.codecs, key_states.dtype
        widths = (key_states.shape[-1], value_states.shape[-1])
        self.decoded_as = (dtype, *widths)  # what the packed rows decode to (change_states and crop decode them)
        if self.group == 1:
            rows = self.where_kept(keys_codec.encode(key_states), values_codec.encode(value_states))
            keys, values = super().update(*rows, *args, **kwargs)
            return keys_codec.decode(keys, dtype, widths[0]), values_codec.decode(values, dtype, widths[1])
        waiting, new_values = self.where_kept(keys_codec.waiting.encode(key_states), values_codec.encode(value_states))
        if self.recent is not None:
            waiting = torch.cat([self.recent[0], waiting], dim=-2)
            new_values = torch.cat([self.recent[1], new_values], dim=-2)
        # what attention reads, decoded into one tensor each: the stored groups, then the waiting rows
        # (the keys at the waiting codec's bits, this update's and those of a group it fills included)
        stored = self.packed_length()
        keys = self._decoded(dtype, widths[0], stored, waiting, keys_codec.waiting)
        values = self._decoded(dtype, widths[1], stored, new_values, values_codec)
        full = waiting.shape[-2] // self.group * self.group
        stored_keys, stored_values = self.store(keys_codec.encode(keys[..., stored:stored + full, :]),
                                                new_values[..., :full, :], *args, **kwargs)
        # cloned where a group was stored: a view would keep the whole of what was concatenated
        self.recent = tuple(rows[..., full:, :].clone() if full else rows for rows in (waiting, new_values))
        keys_codec.decode_into(keys[..., :stored, :], stored_keys[..., :stored, :])
        values_codec.decode_into(values[..., :stored, :], stored_values[..., :stored, :])
        return keys, values

    def store(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends whole groups of packed rows (none, most steps) as the class after this one stores
        them; returns every stored row, where compute runs."""
        return super().update(keys, values, *args, **kwargs)

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole keys and values [batch, heads, tokens, width] decoded where compute runs
        (once it has been updated)."""
        (keys_codec, values_codec), (dtype, key_width, value_width) = self.codecs, self.decoded_as
        if self.group == 1:
            return keys_codec.decode(self.keys, dtype, key_width), values_codec.decode(self.values, dtype, value_width)
        stored, (waiting, recent_values) = self.packed_length(), self.recent
        keys = self._decoded(dtype, key_width, stored, waiting, keys_codec.waiting)
        values = self._decoded(dtype, value_width, stored, recent_values, values_codec)
        if stored:
            keys_codec.decode_into(keys[..., :stored, :], self.keys.to(waiting.device))
            values_codec.decode_into(values[..., :stored, :], self.values.to(waiting.device))
        return keys, values

    @staticmethod
    def _decoded(dtype: torch.dtype, width: int, stored: int, rows: torch.Tensor, codec: KVCodec) -> torch.Tensor:
        """States for stored tokens followed by rows' (packed by codec, decoded into place here); the
        stored tokens' are the caller's to decode into the first columns."""
        states = torch.empty((*rows.shape[:-2], stored + rows.shape[-2], width), dtype=dtype, device=rows.device)
        codec.decode_into(states[..., stored:, :], rows)
        return states

    def change_states(self, change) -> None:
        """Applies change to the keys and values ([batch, heads, columns, width] -> the same, the
        columns changed). Token by token, to the packed rows; in groups of tokens, to the states
        decoded, which are then packed anew from the first column: the keys of groups whose columns
        moved are quantized again, one more rounding."""
        if self.group == 1:
            self.keys, self.values = change(self.keys), change(self.values)
            return
        self.restore(*(change(states) for states in self.states()))

    def restore(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Holds keys and values ([batch, heads, tokens, width] states) anew: whole groups stored, the
        rest waiting."""
        (keys_codec, values_codec), device = self.codecs, self.keys.device
        full = keys.shape[-2] // self.group * self.group
        self.keys = keys_codec.encode(keys[..., :full, :]).to(device)
        self.values = values_codec.encode(values[..., :full, :]).to(device)
        self.recent = (keys_codec.waiting.encode(keys[..., full:, :]), values_codec.encode(values[..., full:, :]))

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last tokens; a group cut into is decoded, its keys that stay waiting again."""
        if self.group == 1 or tokens_to_remove >= 0 or not self.is_initialized:
            super().crop(tokens_to_remove)
            return
        keep, packed = self.get_seq_length() + tokens_to_remove, self.packed_length()
        if keep >= packed:
            self.recent = tuple(rows[..., :keep - packed, :] for rows in self.recent)
            return
        start, device, keys_codec = keep // self.group * self.group, self.recent[0].device, self.codecs[0]
        dtype, key_width, _ = self.decoded_as
        cut = keys_codec.decode(self.keys[..., start:start + self.group, :].to(device), dtype, key_width)
        self.recent = (keys_codec.waiting.encode(cut[..., :keep - start, :]),
                       self.values[..., start:keep, :].to(device).clone())  # not a view of rows the crop frees
        super().crop(start - packed)

    def reset(self) -> None:
        self.recent = None
        super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._recent_rows(lambda states: states.index_select(0, beam_idx.to(states.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._recent_rows(lambda states: states.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._recent_rows(lambda states: states[indices.to(states.device), ...])

    def _recent_rows(self, change) -> None:
        if self.recent is not None:
            self.recent = (change(self.recent[0]), change(self.recent[1]))


class QuantizedDeviceLayer(QuantizedStates, DynamicLayer):
    """A full-attention layer's K/V, quantized, where compute runs."""

    def store(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_initialized and not keys.shape[-2]:
            return self.keys, self.values  # DynamicLayer's torch.cat would copy every stored row for nothing
        return super().store(keys, values, *args, **kwargs)


class QuantizedWindowLayer(QuantizedStates, DynamicSlidingWindowLayer):
    """A sliding-window layer's K/V, quantized, where compute runs."""


class QuantizedHostLayer(QuantizedStates, HostLayer):
    """A full-attention layer's K/V, quantized, in host memory: a step fetches and appends packed bytes."""


class QuantizedDiskLayer(QuantizedStates, DiskLayer):
    """A full-attention layer's K/V, quantized, on disk: a step reads packed bytes, and writes them
    where a group of tokens fills (at 4 bits; each token at 8)."""


class PartialOffloadCache(DynamicCache):
    """A DynamicCache with a fraction of its full-attention layers in host memory, spread evenly,
    and with bits < 16 the K/V of every attention layer quantized (state-space, recurrent and
    linear-attention layers keep their states as they are)."""

    def __init__(self, config: PretrainedConfig, fraction: float, device: Device, streams=None,
                 pool: HostBufferPool | None = None, tokens: int = 0, bits: int = 16, disk: KVDisk | None = None,
                 disk_fraction: float = 0.0):
        """streams: (fetches, appends), the streams the K/V copies go on (new ones if not given); an
        executor keeps one pair for all its caches, since devices hand out streams from a small pool,
        and one pool of host buffers. tokens: the length the job will reach, where it is known, so the
        host buffers are made once at that size instead of growing. bits: 16, 8 or 4. disk: where
        the disk_fraction share of the layers keeps its K/V files."""
        super().__init__(config=config)
        if device.separate_memory and streams is None:
            streams = (device.new_stream(), device.new_stream())
        pool = pool or HostBufferPool(device)
        codecs = kv_codecs(bits) if bits < 16 else None
        on_host = set(host_layers(self.layers, fraction))
        on_disk = set(disk_layers(self.layers, fraction, disk_fraction))
        for i, layer in enumerate(self.layers):
            if i in on_disk:
                self.layers[i] = (DiskLayer(disk, tokens) if codecs is None
                                  else QuantizedDiskLayer(disk, tokens, codecs=codecs))
            elif i in on_host:
                self.layers[i] = (HostLayer(device, streams, pool, tokens) if codecs is None
                                  else QuantizedHostLayer(device, streams, pool, tokens, codecs=codecs))
            elif codecs is not None and type(layer) is DynamicLayer:
                self.layers[i] = QuantizedDeviceLayer(codecs=codecs)
            elif codecs is not None and type(layer) is DynamicSlidingWindowLayer:
                # its oldest tokens leave one at a time: a group of keys would be split
                self.layers[i] = QuantizedWindowLayer(layer.sliding_window, codecs=kv_codecs(bits, by_token=True))

    def wait_for_copies(self) -> None:
        """Waits for the appends and fetches still in flight: before the host buffers are freed
        (unpinned and unmapped), nothing may still copy into or out of them."""
        for layer in self.layers:
            if isinstance(layer, (HostLayer, DiskLayer)):
                layer.wait_for_copies()

    def return_host_buffers(self) -> None:
        """The job is done with the cache: its host buffers go back to the pool, for the next one,
        and its K/V files are removed."""
        for layer in self.layers:
            if isinstance(layer, (HostLayer, DiskLayer)):
                layer.reset()

    @property
    def offloaded(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, HostLayer)]

    @property
    def on_disk(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, DiskLayer)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # One layer ahead, its copy running while this layer's attention does. Not past the last
        # layer: a fetch for a step that may never come would outlive generate.
        following = self.layers[layer_idx + 1] if layer_idx + 1 < len(self.layers) else None
        if isinstance(following, HostLayer):
            following.prefetch(following.stored_tokens(key_states.shape[-2]))  # the same new tokens reach it
        elif isinstance(following, DiskLayer):
            following.prefetch()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def host_layers(layers: list, fraction: float) -> list[int]:
    """Which layers' K/V live in host memory: that share of the full-attention ones, spread evenly,
    so that each follows one that is not, whose attention hides its copy (sliding-window and
    linear-attention layers keep their small caches on the device)."""
    eligible = [i for i, layer in enumerate(layers) if type(layer) is DynamicLayer]
    return spread(eligible, math.ceil(fraction * len(eligible) - 1e-9))


def disk_layers(layers: list, host_fraction: float, fraction: float) -> list[int]:
    """Which layers' K/V live on disk: that share of the full-attention ones, spread evenly among
    those host_layers leaves on the device."""
    eligible = [i for i, layer in enumerate(layers) if type(layer) is DynamicLayer]
    on_host = set(host_layers(layers, host_fraction))
    rest = [i for i in eligible if i not in on_host]
    return spread(rest, math.ceil(fraction * len(eligible) - 1e-9))


def disk_share(config: PretrainedConfig, host_fraction: float, fraction: float) -> float:
    """The share of all layers whose K/V a PartialOffloadCache of these fractions keeps on disk."""
    layers = DynamicCache(config=config).layers
    return len(disk_layers(layers, host_fraction, fraction)) / len(layers) if layers else 0.0


def offloaded_share(config: PretrainedConfig, fraction: float) -> float:
    """The share of all layers whose K/V a PartialOffloadCache of this fraction keeps on the host."""
    layers = DynamicCache(config=config).layers
    return len(host_layers(layers, fraction)) / len(layers) if layers else 0.0

