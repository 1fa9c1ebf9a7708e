"""The batch size: the one asked for, or (--batch-size auto) the largest batch whose K/V cache and
activations fit in the memory the weights left, since one pass over the weights serves the whole batch.

    batch = decide_batch_size(None, fits=lambda: largest_batch(lm, prompt_tokens=[12, 40, 7], max_new_tokens=64))

The estimate is deliberately simple and errs large: K/V for every position of the longest prompt
plus every new token, at the policy's kv_bits (with what reading quantized K/V decodes), and the
prefill's activations (the widest moment of a run), all as zerolite.memory_model counts them, the
planner's cost model alike. In micro-batches (--micro-batches) the device holds one micro-batch's
activations at a time, and every other sequence only what it carries through the pass. Host memory
is what the machine has available, or less where a memory cgroup limits this process
(zerolite.runtime.host_memory).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import DynamicCache

from zerolite.errors import ZeroliteError
from zerolite.memory_model import (
    ModelShape,
    kv_bytes_per_token,
    kv_bytes_per_token_by_layer,
    kv_decode_bytes_per_token,
    kv_filling_group_bytes,
    kv_waiting_bytes,
    prefill_activation_bytes,
    prefill_carried_bytes,
)
from zerolite.runtime.host_memory import host_room
from zerolite.runtime.kv_cache import disk_layers, host_layers

MARGIN = 0.10         # of the free memory, kept for the allocator's fragmentation and everything unforeseen
MAX_BATCH = 4096


def decide_batch_size(asked: int | None, drafting: bool = False, planned: int | None = None,
                      fits: Callable[[], int] | None = None) -> int | None:
    """The one place a job's batch size is decided, from what is known so far:

    1. drafting (speculative decoding, which is for one sequence): 1
    2. asked (the batch size given; None: auto): that
    3. auto: the largest batch the memory holds (fits(), once the model is loaded: largest_batch's),
       at most the planner's choice for the job (planned); None before the model is loaded
    """
    if drafting:
        return 1
    if asked is not None:
        return asked
    if fits is None:
        return None
    return min(fits(), planned or MAX_BATCH)


def largest_batch(lm, prompt_tokens: list[int], max_new_tokens: int) -> int:
    """The largest batch, up to the number of prompts, that fits where the plan runs."""
    config = lm.model.config
    dtype = lm.model.dtype
    longest = max(prompt_tokens)
    length = longest + max_new_tokens
    bits = lm.policy.kv_bits
    kv_offload = host_kv_share(config, lm.policy.kv_offload, dtype) if lm.policy.kv_offload else 0.0
    kv_disk = disk_kv_share(config, lm.policy.kv_offload, lm.policy.kv_disk, dtype) if lm.policy.kv_disk else 0.0
    # per sequence, with the keys of a group not yet full waiting at 8 bits (4-bit K/V)
    kv = kv_bytes_per_token(config, dtype, bits) * length + kv_waiting_bytes(config, dtype, bits)
    # K/V on disk is in host memory a layer at a time, twice over: the layer read ahead, and the one attended
    disk_staging = 2 * max(kv_bytes_per_token_by_layer(config, dtype, bits), default=0) * length if kv_disk else 0
    # and at 4 bits each such layer's group of tokens not yet full, where compute runs
    disk_filling = int(kv_filling_group_bytes(config, dtype, bits) * kv_disk)
    # the prefill's, or the widest moment of a decode step reading quantized K/V (both on the device)
    activations = max(prefill_activation_bytes(ModelShape.of(config), longest, dtype),
                      kv_decode_bytes_per_token(config, dtype, bits) * length)

    host_free = host_room() * (1 - MARGIN)
    if lm.device.separate_memory:
        device_free = lm.device.memory()[0] * (1 - MARGIN)
        # K/V that grows a token each step takes more than its bytes where the allocator's segments cannot grow
        # on the device: its own layers' K/V, and the layer on disk being attended
        on_device = int(kv * (1 - kv_offload - kv_disk) + disk_staging / 2) + disk_filling
        per_sequence_device = lm.device.growing_cost(on_device) + activations
        # host K/V buffers grow by doubling and are pinned: up to twice the bytes, as pinning rounds them
        host_kv = int(2 * kv * kv_offload) + disk_staging
        per_sequence_host = lm.device.pinned_cost(host_kv) if host_kv else 0
    else:
        device_free = host_free
        per_sequence_device = int(kv * (1 - kv_disk)) + disk_staging + disk_filling + activations
        per_sequence_host = 0.0
    fits = fitting_rows(device_free, per_sequence_device, activations, lm.policy.micro_batches,
                        prefill_carried_bytes(ModelShape.of(config), longest, dtype))
    if per_sequence_host:
        fits = min(fits, int(host_free // per_sequence_host))
    if fits < 1:
        raise ZeroliteError(
            f"not even one sequence of {length} tokens fits: it needs {per_sequence_device / 1e9:.2f} GB and "
            f"{device_free / 1e9:.2f} GB is free; lower `max_new_tokens`, use `kv_offload`, "
            "or keep fewer blocks resident"
        )
    return max(1, min(fits, len(prompt_tokens), MAX_BATCH))


def fitting_rows(free: float, per_sequence: float, activations: float, micro_batches: int, carried: int) -> int:
    """How many sequences fit in free bytes, each taking per_sequence there (its K/V and its
    activations). In micro-batches only the largest micro-batch's rows take their activations at
    once; every other row keeps what it carries through the pass (carried) beside its K/V."""
    if micro_batches == 1:
        return int(free // per_sequence)
    kept = per_sequence - activations + carried
    rows = int(free // (kept + activations / micro_batches))
    while rows > 0 and rows * kept + -(-rows // micro_batches) * activations > free:
        rows -= 1
    return rows


def host_kv_share(config, fraction: float, dtype) -> float:
    """The share of the K/V cache's bytes that a PartialOffloadCache of this fraction keeps in host
    memory: its layers' share of the bytes, not of the layers, which a hybrid's state-space layers
    (none of them offloaded, and holding no K/V) would dilute."""
    per_layer = kv_bytes_per_token_by_layer(config, dtype)
    text = config.get_text_config(decoder=True)
    offloaded = host_layers(DynamicCache(config=text).layers, fraction)
    return sum(per_layer[i] for i in offloaded) / sum(per_layer) if sum(per_layer) else 0.0


def disk_kv_share(config, host_fraction: float, fraction: float, dtype) -> float:
    """The share of the K/V cache's bytes that a PartialOffloadCache keeps on disk (host_kv_share's, for kv_disk)."""
    per_layer = kv_bytes_per_token_by_layer(config, dtype)
    text = config.get_text_config(decoder=True)
    on_disk = disk_layers(DynamicCache(config=text).layers, host_fraction, fraction)
    return sum(per_layer[i] for i in on_disk) / sum(per_layer) if sum(per_layer) else 0.0
