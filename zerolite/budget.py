"""How many bytes of weights each memory tier may hold: the user's --gpu-memory and --cpu-memory,
or, when not given, what is free now less headroom for what the run itself needs.

    budgets = Budgets.make(manifest, policy)   # budgets.device, budgets.host in bytes

The headroom is the ring of slots (their size is known) plus a reserve for activations and the
K/V cache, which depend on the batch and lengths the plan cannot know yet: a tenth of the memory,
at least RESERVE_BYTES. --batch-size auto later fills what the weights left.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from zerolite.manifest import Manifest
from zerolite.policy import Policy

RESERVE_BYTES = 2 << 30
RESERVE_SHARE = 0.10


@dataclass(frozen=True)
class Budgets:
    device: int   # bytes of blocks that may stay resident on the GPU (0 on a CPU device: there the host budget rules)
    host: int     # bytes of layers that may stay in host memory instead of streaming from disk

    @classmethod
    def make(cls, manifest: Manifest, policy: Policy) -> Budgets:
        device = policy.torch_device
        layers = manifest.layer_names
        slot = max((manifest.block(name).length for name in layers), default=0)
        ring = policy.prefetch_depth * slot
        if device.type == "cuda":
            if policy.gpu_memory is not None:
                on_device = policy.gpu_memory
            else:
                free, total = torch.cuda.mem_get_info(device)
                on_device = max(free - ring - reserve(total), 0)
        else:
            on_device = 0
        if policy.cpu_memory is not None:
            in_host = policy.cpu_memory
        else:
            memory = psutil.virtual_memory()
            always = 0 if device.type == "cuda" else manifest.nbytes(b.name for b in manifest.blocks if b.name not in layers)
            in_host = max(memory.available - ring - always - reserve(memory.total), 0)
        return cls(on_device, in_host)


def reserve(total: int) -> int:
    """Memory left for activations and the K/V cache when the budget is not given."""
    return max(RESERVE_BYTES, int(RESERVE_SHARE * total))
