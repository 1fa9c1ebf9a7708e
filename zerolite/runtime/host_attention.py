"""Attention over K/V in host memory computed by the host, where the K/V lives (`kv_attention` cpu):
the new tokens' keys and values go to the host, the query after them and the attention's output
back, never the layer's K/V (FlexGen, ZeRO-Inference). For a 70B at batch 64 and 2k context with
half its layers' K/V in host memory, that is about 21 GB a step the link no longer carries.

    caches = host_attending_caches(model, device)   # None, with a line on stderr, where the family can't
    cache = caches.new(model.config, fraction=0.5)    # its host layers are HostAttendedLayers

It rides on transformers' own code. Every attention module hands what `cache.update(...)` returns
to `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`. A host-attended layer appends the new
tokens to its host buffers and returns views of them, tagged with itself; the model's attention
implementation (sdpa or eager) gives way to one registered as "zerolite_host_<base>" (with the
base's mask) that runs a tagged call through the layer (HostAttendedLayer.attend), which computes
the base's own function on the host, and passes every other call to the base unchanged. The
arithmetic is the base's: on a CPU, and on the simulated device, the tokens are transformers'.

A family whose attention does something else with the cache's K/V first (DeepSeek-V3's MLA
expands its latent with kv_b_proj, whose weights are on the device) is found by a probe run on
the meta device (unfit()); its attention stays on the device, said in one line.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn
from torch.utils._pytree import tree_map
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from zerolite.hf import build_meta_model, cache_keyword
from zerolite.io.device import Device
from zerolite.runtime.kv_cache import HostLayer, OffloadedCaches, PartialOffloadCache, QuantizedStates
from zerolite.runtime.kv_disk import KVDisk

PREFIX = "zerolite_host_"
BASES = ("sdpa", "eager")  # implementations that run on a CPU: flash and flex kernels do not
TAG = "_zerolite_attended_by"  # on the K/V views a host-attended layer hands its attention: the layer


class HostStaging:
    """What the host-attended layers of one model's caches share: pinned buffers by role for what
    crosses the link each call, and the stream the outputs go back on. Each call's wait for its
    inputs also sees the last call's output copied out of its buffer: compute waited for that copy
    before it went on."""

    def __init__(self, device: Device):
        self.device = device
        self.stream = device.new_stream()
        self._buffers: dict[str, torch.Tensor] = {}
        self.calls = 0  # attention calls computed on the host

    def host(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor shaped as like, from the role's buffer (grown to twice what is asked:
        the query grows at prefill only, the mask a column a step)."""
        nbytes = like.numel() * like.element_size()
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[role] = self.device.pinned_empty(max(2 * nbytes, 4096))
        return buffer[:nbytes].view(like.dtype).view(like.shape)


class HostAttendedLayer(HostLayer):
    """One layer's K/V in host memory, attended there. update() appends the new tokens to the host
    buffers (as HostLayer does: sequence-first, on the appends stream) and hands the attention views
    of them; nothing is fetched. Quantized (--kv-bits): QuantizedHostAttendedLayer."""

    def __init__(self, host: Device, streams, pool, tokens: int, staging: HostStaging):
        super().__init__(host, streams, pool, tokens)
        self.staging = staging

    def prefetch(self, extra: int = 0) -> None:
        """Nothing goes to the device: attention comes to the K/V."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states)
        return self.tagged(self.keys[...], self.values[...])  # views of their own: the tag does not stay on self.keys

    def tagged(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values marked as this layer's, for the attention function to send them to attend()."""
        setattr(keys, TAG, self)
        setattr(values, TAG, self)
        return keys, values

    def attend(self, function, module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask, *args, **kwargs):
        """function (the base implementation) over this layer's K/V, computed on the host:

        1. the query, the mask, the module's own tensors (gpt-oss's sinks) and every tensor
           argument to the host: copies on the compute stream, after the work that made them; the
           host waits for them and for this layer's appends (the keys were made before the query)
        2. function on the host, over the host buffers (decoded there, at 8 or 4 bits)
        3. its outputs back to the device on a stream of their own, into memory compute allocated
           (so that stream waits for compute first); compute waits for them before using them
        """
        staging, device = self.staging, self.host
        staging.calls += 1
        if not device.separate_memory:
            return function(module, query, keys, values, mask, *args, **kwargs)
        compute = device.compute_stream()
        own = {name: tensor for name, tensor in [*module._parameters.items(), *module._buffers.items()]
               if tensor is not None}
        copies = []

        def to_host(tensor):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            target = staging.host(f"in:{len(copies)}", tensor)
            copies.append((target, tensor.contiguous()))
            return target

        sent = tree_map(to_host, {"query": query, "mask": mask, "args": args, "kwargs": kwargs, "own": own})
        for target, source in copies:
            device.copy(target, source, compute)
        device.record(compute).synchronize()
        if self._appended is not None:
            self._appended.synchronize()

        twin = copy.copy(module)  # the same module, its own tensors those now on the host
        twin._parameters = {name: sent["own"].get(name) for name in module._parameters}
        twin._buffers = {name: sent["own"].get(name) for name in module._buffers}
        output = function(twin, sent["query"], keys, values, sent["mask"], *sent["args"], **sent["kwargs"])

        staged = []

        def stage(tensor):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            host = staging.host(f"out:{len(staged)}", tensor)
            host.copy_(tensor)
            result = torch.empty(tensor.shape, dtype=tensor.dtype, device=query.device)
            staged.append((result, host))
            return result

        output = tree_map(stage, output)
        device.wait_stream(staging.stream, compute)
        for result, host in staged:
            device.copy(result, host, staging.stream)
        device.wait_event(compute, device.record(staging.stream))
        return output


class QuantizedHostAttendedLayer(QuantizedStates, HostAttendedLayer):
    """One layer's K/V quantized in host memory, attended there, with the codecs every other tier
    uses (QuantizedStates). Each update's new tokens are packed where compute made them, and only
    their rows cross to the host; the rest is the host's: at 4 bits the keys of the group not yet
    full wait there at 8 bits, a group that fills is packed per channel there and written into the
    host buffers, and the layer's K/V is decoded there for its attention."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.tagged(*super().update(key_states, value_states, *args, **kwargs))

    def where_kept(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows copied to the host through pinned staging buffers, the host waiting for them (it
        attends over them next), and then held in memory of their own: the staging is the next call's."""
        device = self.host
        if not device.separate_memory:
            return rows
        compute = device.compute_stream()
        staged = [self.staging.host(f"rows:{i}", each) for i, each in enumerate(rows)]
        for target, each in zip(staged, rows):
            device.copy(target, each.contiguous(), compute)
        device.record(compute).synchronize()
        return tuple(target.clone() for target in staged)

    def _copy_in(self, at: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The rows are on the host already: written into its buffers where they stand."""
        for buffer, rows in zip(self._buffers, (key_states, value_states)):
            buffer[at:at + rows.shape[-2]] = rows.permute(2, 0, 1, 3)


class HostAttendedCache(PartialOffloadCache):
    """A PartialOffloadCache whose layers in host memory are attended there (HostAttendedLayer,
    QuantizedHostAttendedLayer with the codecs PartialOffloadCache chose); the others are as it makes them."""

    def __init__(self, config: PretrainedConfig, fraction: float, device: Device, streams, pool, tokens: int,
                 bits: int, staging: HostStaging, disk: KVDisk | None = None, disk_fraction: float = 0.0):
        super().__init__(config, fraction, device, streams, pool, tokens, bits, disk, disk_fraction)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, HostLayer):
                streams = (layer.fetches, layer.appends) if layer.appends is not None else None
                self.layers[i] = (QuantizedHostAttendedLayer(device, streams, layer.pool, tokens, staging,
                                                             codecs=layer.codecs)
                                  if isinstance(layer, QuantizedStates)
                                  else HostAttendedLayer(device, streams, layer.pool, tokens, staging))


class HostAttendingCaches(OffloadedCaches):
    """OffloadedCaches whose caches attend their host layers on the host, sharing one HostStaging."""

    def __init__(self, device: Device, disk: KVDisk | None = None):
        super().__init__(device, disk)
        self.staging = HostStaging(device)

    def new(self, config: PretrainedConfig, fraction: float, tokens: int = 0, bits: int = 16,
            disk_fraction: float = 0.0) -> DynamicCache:
        if fraction > 0:
            return HostAttendedCache(config, fraction, self.device, self.streams, self.pool, tokens, bits,
                                     self.staging, self.disk, disk_fraction)
        return super().new(config, fraction, tokens, bits, disk_fraction)


def host_attending_caches(model: nn.Module, device: Device, say: bool = True,
                          disk: KVDisk | None = None) -> HostAttendingCaches | None:
    """Caches whose host layers are attended on the host, model's attention made to send them there;
    None where its family's attention can't be (said in one line on stderr where say)."""
    config = model.config
    reason = unfit(config)
    if reason is not None:
        if say:
            print(f"zerolite: attention over K/V in host memory runs on the device: {config.model_type}'s attention "
                  f"{reason}", file=sys.stderr)
        return None
    config._attn_implementation = registered(config._attn_implementation)
    return HostAttendingCaches(device, disk)


def registered(base: str) -> str:
    """The name of the attention implementation that computes host-attended layers on the host
    and every other layer with base, registered (with base's mask) on first use."""
    name = PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, attention_over(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def attention_over(base: str):
    """The attention function registered for base: a call whose keys and values a host-attended
    layer gave goes to that layer, to run base's function on the host; any other is base's own."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  *args, **kwargs):
        function = base_function(base, module)
        layer = getattr(key, TAG, None)
        if layer is None or getattr(value, TAG, None) is not layer:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        return layer.attend(function, module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def base_function(base: str, module: nn.Module):
    """sdpa's function is registered; eager's is the one each modeling file defines for itself."""
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


class Reached(Exception):
    """The probe's attention call came with the K/V its cache gave."""


class ProbeLayer(DynamicLayer):
    """A full-attention layer of the probe's cache: its K/V tagged as a host-attended layer's are."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = (states[...] for states in super().update(key_states, value_states, *args, **kwargs))
        setattr(keys, TAG, self)
        setattr(values, TAG, self)
        return keys, values

    def attend(self, *args, **kwargs):
        raise Reached


def unfit(config: PretrainedConfig) -> str | None:
    """None where the family's attention hands the K/V the cache gives straight to the attention
    function, so that a host-attended layer's are attended on the host; else why not (the end of a
    sentence). Told by a forward on the meta device (a tenth of a second for a 70B), up to the first
    full-attention layer's attention call."""
    base = config._attn_implementation
    if base not in BASES:
        return f"runs as {base}, which has no CPU kernel"
    # A model of its own, its config a copy (the probe's implementation is set on it), in bf16: the
    # experts' grouped_mm of a mixture's layers before the first full-attention one takes no other
    model = build_meta_model(copy.deepcopy(config), torch.bfloat16)
    model.config._attn_implementation = registered(base)
    cache = DynamicCache(config=model.config)
    cache.layers = [ProbeLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if not any(isinstance(layer, ProbeLayer) for layer in cache.layers):
        return "has no full-attention layer"
    try:
        with torch.no_grad():
            # embedded first: ids would be searched for padding, which meta tensors can't tell (GPT-2)
            embedded = model.get_input_embeddings()(torch.zeros((1, 2), dtype=torch.long, device="meta"))
            model(inputs_embeds=embedded, use_cache=True, **{cache_keyword(): cache})
    except Reached:
        return None
    except Exception as e:  # whatever it does on the way, it is not what runs on the host
        return f"does not take the K/V as the cache gives them (the probe: {type(e).__name__}: {str(e)[:80]})"
    return "does not take the K/V as the cache gives them"
