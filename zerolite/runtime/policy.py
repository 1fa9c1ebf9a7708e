"""What the user asked for: where the weights live, where they run, and how far ahead to read.

A Policy is a plain frozen value, checked once when it is made; everything downstream trusts it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device, cuda_available, resolve
from zerolite.memory_model import KV_BITS

OFFLOAD_CHOICES = ("nvme", "cpu", "none")
EXPERTS_CHOICES = ("routed", "whole", "device", "cpu", "auto")
KV_ATTENTION_CHOICES = ("auto", "device", "cpu")


@dataclass(frozen=True)
class Policy:
    offload: str = "nvme"              # "nvme": stream blocks from the layout on disk; "cpu": hold them in
                                       # host memory (pinned on CUDA); "none": every block resident
    device: object = "auto"            # "cuda", "cuda:N", "cpu", "auto" (cuda when available), or a
                                       # zerolite.io.device.Device (the tests' simulated one)
    prefetch_depth: int = 2            # slots in the ring: 1 reads then computes, 2 reads block i+1
                                       # while block i computes (double buffering), n reads n-1 ahead
    io_backend: str = "auto"           # the engine's backend: "io_uring", "pread" or "auto"
    io_queue_depth: int = 32           # engine reads in flight
    io_chunk_bytes: int = 1 << 20      # size of each engine read
    gpu_memory: int | None = None      # bytes of blocks kept resident on the GPU; None: what is free, less headroom
    cpu_memory: int | None = None      # bytes of layers kept in host memory (--offload nvme); None: likewise
    kv_offload: float = 0.0            # fraction of the layers whose K/V cache lives in host memory
    kv_bits: int = 16                  # the K/V cache's bits: 16 (the model's dtype), or 8 / 4 (group-wise
                                       # integers with their scales, zerolite.quant.kv_codec), in every tier
    experts: str = "auto"              # a mixture of experts' layers: "routed" (or "device") moves only the
                                       # experts the router picks, "whole" every expert, as a dense layer
                                       # streams; "cpu" computes the routed experts on the host from host
                                       # memory, on a GPU, moving only the hidden states; "auto" is routed
                                       # unless a plan chose (generate's: zerolite.planner.experts_side)
    cpu_expert_layers: int | None = None  # with experts cpu: of the layers read per expert, how many the host
                                          # computes the experts of, spread among the rest (None: all)
    kv_disk: float = 0.0               # share of the layers whose K/V lives in a file per layer on disk, read one
                                       # layer ahead through the engine
    kv_attention: str = "auto"         # attention over K/V off the device: "device" copies it there, "cpu" computes
                                       # it where it lives (only the query and the output cross the link); "auto"
                                       # is device unless a plan chose (generate's: zerolite.planner.kv_side)
    micro_batches: int = 1             # device micro-batches per pass over the weights: the device holds one
                                       # micro-batch's activations at a time

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_CHOICES:
            raise ZeroliteError(f"unknown `offload` {self.offload!r}: choose one of {', '.join(OFFLOAD_CHOICES)}")
        if isinstance(self.device, str):
            if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:[0-9]+", self.device):
                raise ZeroliteError(f"unknown `device` {self.device!r}: choose cuda, cuda:N, cpu or auto")
            if self.device.startswith("cuda") and not cuda_available():
                raise ZeroliteError(
                    f"`device` {self.device} asked for, but this machine has no usable CUDA device "
                    "(PyTorch sees no CUDA device): use `device` cpu"
                )
        if self.experts not in EXPERTS_CHOICES:
            raise ZeroliteError(f"unknown `experts` {self.experts!r}: choose one of {', '.join(EXPERTS_CHOICES)}")
        if self.experts == "device":
            object.__setattr__(self, "experts", "routed")  # the experts routed to, moved to the device
        if self.cpu_expert_layers is not None and (self.experts != "cpu" or self.cpu_expert_layers < 0):
            raise ZeroliteError(f"`cpu_expert_layers` counts the layers whose experts the CPU computes: give "
                                f"0 or more with `experts` cpu, not {self.cpu_expert_layers} with {self.experts}")
        if self.prefetch_depth < 1:
            raise ZeroliteError(f"`prefetch_depth` must be at least 1, got {self.prefetch_depth}")
        for name, budget in (("gpu_memory", self.gpu_memory), ("cpu_memory", self.cpu_memory)):
            if budget is not None and budget < 0:
                raise ZeroliteError(f"`{name}` must not be negative, got {budget} bytes")
        if not 0.0 <= self.kv_offload <= 1.0:
            raise ZeroliteError(f"`kv_offload` is the fraction of layers whose K/V cache lives in host memory: "
                                f"give a number from 0 to 1, not {self.kv_offload}")
        if not 0.0 <= self.kv_disk <= 1.0 or self.kv_offload + self.kv_disk > 1.0:
            raise ZeroliteError(f"`kv_disk` is the fraction of layers whose K/V cache lives on disk: give a number "
                                f"from 0 to 1 that, with `kv_offload`, makes at most 1, not {self.kv_disk}")
        if self.kv_attention not in KV_ATTENTION_CHOICES:
            raise ZeroliteError(f"unknown `kv_attention` {self.kv_attention!r}: choose one of "
                                f"{', '.join(KV_ATTENTION_CHOICES)}")
        if self.micro_batches < 1:
            raise ZeroliteError(f"`micro_batches` must be at least 1, got {self.micro_batches}")
        if self.kv_bits not in KV_BITS:
            raise ZeroliteError(f"`kv_bits` keeps the K/V cache at 16 bits (the model's dtype), 8 or 4: "
                                f"choose one of {', '.join(map(str, KV_BITS))}, not {self.kv_bits}")

    @property
    def per_expert(self) -> bool:
        """Whether a mixture's layers read only the experts the router picks (on the device or the host)."""
        return self.experts != "whole"

    def target(self) -> Device:
        """The Device the policy runs on."""
        return resolve(self.device)


SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, name: str) -> int:
    """A memory budget such as "24GB", "1.5GiB" or "0" (no unit needed for nothing) in bytes; name
    is what an error calls it."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match and match[2].lower() in SIZE_UNITS:
        return int(float(match[1]) * SIZE_UNITS[match[2].lower()])
    if match and not match[2] and float(match[1]) == 0:
        return 0
    raise ZeroliteError(f"{name} {text!r} is not a size: write it with a unit, as in 24GB, 1.5GiB or 512MB (or 0)")


