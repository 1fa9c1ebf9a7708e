"""What the user asked for: where the weights live, where they run, and how far ahead to read.

A Policy is a plain frozen value, checked once when it is made; everything downstream trusts it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from zerolite.errors import ZeroliteError

OFFLOAD_CHOICES = ("nvme", "cpu", "none")


@dataclass(frozen=True)
class Policy:
    offload: str = "nvme"              # "nvme": stream blocks from the layout on disk; "cpu": hold them in
                                       # host memory (pinned on CUDA); "none": every block resident
    device: str = "auto"               # "cuda", "cpu", or "auto" (cuda when available)
    prefetch_depth: int = 2            # slots in the ring: 1 reads then computes, 2 reads block i+1
                                       # while block i computes (double buffering), n reads n-1 ahead
    io_backend: str = "auto"           # the engine's backend: "io_uring", "pread" or "auto"
    io_queue_depth: int = 32           # engine reads in flight
    io_block_bytes: int = 1 << 20      # size of each engine read

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_CHOICES:
            raise ZeroliteError(f"unknown --offload {self.offload!r}: choose one of {', '.join(OFFLOAD_CHOICES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ZeroliteError(f"unknown --device {self.device!r}: choose cuda, cpu or auto")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ZeroliteError(
                f"--device {self.device} asked for, but this machine has no usable CUDA device "
                "(torch.cuda.is_available() is False): use --device cpu"
            )
        if self.prefetch_depth < 1:
            raise ZeroliteError(f"--prefetch-depth must be at least 1, got {self.prefetch_depth}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def default_layout_path(model: str, dtype: str | None) -> Path:
    """Where a model given as a checkpoint is converted to when no --path is given: zerolite's cache."""
    from zerolite.gguf_source import cache_dir

    local = Path(model).expanduser()
    source = str(local.resolve()) if local.exists() else model
    stem = local.name if local.exists() else model.replace("/", "--")
    digest = hashlib.sha256(source.encode()).hexdigest()[:10]  # two folders both named "model" differ
    return cache_dir() / "layouts" / f"{stem}-{digest}-{dtype or 'auto'}"
