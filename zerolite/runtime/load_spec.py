"""What one load was asked for, as a frozen value: built once from zerolite.load's keywords or from
the command line's load options, never edited afterwards.

    spec = LoadSpec(model="/nvme/bloom", offload="nvme", cpu_memory="24GB")
    spec = dataclasses.replace(spec, prefetch_depth=4)    # the planner's choice: a new spec
    policy = spec.policy()

The policy's settings left as None take Policy's defaults; sizes given as text ("24GB") are read
into bytes when the spec is made, so a bad one is said before anything else runs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from zerolite.runtime.policy import Policy, parse_size


@dataclass(frozen=True)
class LoadSpec:
    model: str | os.PathLike | None = None     # a layout folder, or a checkpoint to convert first (None: the
                                               # built-in model)
    offload: str = "nvme"                      # where the blocks live while running: nvme, cpu or none
    path: str | os.PathLike | None = None      # where the checkpoint is converted, or the layout to run
    device: object = "auto"                    # cuda, cuda:N, cpu, auto, or a zerolite.io.device.Device
    dtype: str | None = None                   # bf16, fp16 or fp32 when converting (None: the config's)
    weights: str | None = None                 # stored, int8 or int4: the format the layers are converted to
    allow_pickle: bool = False                 # read pickled .bin weights when converting
    draft: str | os.PathLike | None = None     # speculative decoding's draft: a layout, a checkpoint, self-int4
                                               # or self-int8
    draft_group_size: int | None = None        # a self-int4 draft's input weights per scale
    # The policy's settings (zerolite.runtime.policy), None where its default stands
    prefetch_depth: int | None = None
    gpu_memory: int | str | None = None        # bytes, or a size such as "20GB"
    cpu_memory: int | str | None = None
    kv_offload: float | None = None
    kv_bits: int | None = None
    experts: str | None = None
    cpu_expert_layers: int | None = None
    kv_disk: float | None = None
    kv_attention: str | None = None
    micro_batches: int | None = None
    io_backend: str | None = None
    io_queue_depth: int | None = None
    io_chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        for budget in ("gpu_memory", "cpu_memory"):
            if isinstance(getattr(self, budget), str):
                object.__setattr__(self, budget, parse_size(getattr(self, budget), f"`{budget}`"))

    def policy(self) -> Policy:
        """The Policy this spec asks for (its checks raise here)."""
        given = {field.name: getattr(self, field.name) for field in dataclasses.fields(Policy)
                 if field.name in ("offload", "device") or getattr(self, field.name) is not None}
        return Policy(**given)
