"""How many bytes of weights each memory tier may hold: the user's --gpu-memory and --cpu-memory,
or, when not given, what is free now less headroom for what the run itself needs.

    budgets = Budgets.make(manifest, policy, device)   # budgets.device, budgets.host in bytes

The headroom is the ring of slots (their size is known, and on a GPU their host buffers are pinned:
counted at what pinning them really takes), on a GPU the workspace a streamed quantized layer's
dequantisation takes, plus a reserve for activations and the K/V cache, which depend on the batch
and lengths the plan cannot know yet: a tenth of the memory,
at least RESERVE_BYTES. --batch-size auto later fills what the weights left. The host budget is a
node's: the ranks torchrun starts on it hold one copy of the weights, and a ring and headroom each.
Ranks that share one GPU (a launcher that shows each its own CUDA_VISIBLE_DEVICES, all the same
GPU) split it: each budgets its share of the free memory as if it were a GPU of that size.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from zerolite.io.device import Device
from zerolite.layout.manifest import Manifest
from zerolite.quant.linear import cpu_dequantize_workspace, dequantize_workspace
from zerolite.runtime.policy import Policy

RESERVE_BYTES = 2 << 30
RESERVE_SHARE = 0.10


@dataclass(frozen=True)
class Budgets:
    device: int   # bytes of blocks that may stay resident on the GPU (0 where host memory is the device's)
    host: int     # bytes of layers that may stay in host memory instead of streaming from disk

    @classmethod
    def make(cls, manifest: Manifest, policy: Policy, device: Device, ranks_here: int = 1,
             ranks_on_gpu: int = 1) -> Budgets:
        """ranks_here: the ranks on this node (torchrun). They share one host copy of the layers
        (and, on a CPU, of the resident blocks), so --cpu-memory is the node's; each has its own
        ring and its own headroom. ranks_on_gpu: the ranks running on this rank's GPU (shared_gpu),
        each taking that share of its free memory (--gpu-memory is each rank's own)."""
        layers = manifest.layer_names
        slot = max((manifest.block(name).length for name in layers), default=0)
        ring_on_device = policy.prefetch_depth * device_slot_bytes(manifest, layers, policy) if device.separate_memory \
            else 0
        ring_on_host = policy.prefetch_depth * device.pinned_cost(slot)
        if not device.separate_memory:
            on_device = 0
        elif policy.gpu_memory is not None:
            on_device = policy.gpu_memory
        else:
            free, total = (size // ranks_on_gpu for size in device.memory())
            on_device = max(free - ring_on_device - reserve(total) - dequantize_workspace(manifest), 0)
        if policy.cpu_memory is not None:
            in_host = policy.cpu_memory
        else:
            memory = psutil.virtual_memory()
            always = (0 if device.separate_memory
                      else manifest.nbytes(b.name for b in manifest.blocks if b.name not in layers))
            workspace = 0 if device.separate_memory else cpu_dequantize_workspace(manifest)  # a CPU's prefill
            in_host = max(memory.available - ranks_here * (ring_on_host + reserve(memory.total) + workspace) - always,
                          0)
        return cls(on_device, in_host)


def device_slot_bytes(manifest: Manifest, names, policy: Policy) -> int:
    """What a ring slot on a GPU takes for these blocks: the widest, or where the host computes
    every layer's experts (`experts` cpu, cpu_expert_layers unset), the widest dense part: a
    mixture's experts never go to the device then."""
    dense = policy.experts == "cpu" and policy.cpu_expert_layers is None
    return max((manifest.block(name).dense_length if dense else manifest.block(name).length for name in names),
               default=0)


def reserve(total: int) -> int:
    """Memory left for activations and the K/V cache when the budget is not given."""
    return max(RESERVE_BYTES, int(RESERVE_SHARE * total))
