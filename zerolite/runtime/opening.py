"""What each rank opens before it loads anything: the layout (checked against what was asked),
the device it runs on, and the tokenizer.

    opened = world.run_on_all(lambda: open_on_rank(folder, dtype, policy, world, drafting), "opening the layout")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

from zerolite.distributed.world import World
from zerolite.hf import load_tokenizer, refuse_what_its_cache_cannot_do
from zerolite.io.device import Device
from zerolite.layout.folder import Layout
from zerolite.runtime.loader import open_layout, rank_device
from zerolite.runtime.policy import Policy


@dataclass(frozen=True)
class Opened:
    layout: Layout
    device: Device      # this rank's (under torchrun, the GPU of its LOCAL_RANK)
    tokenizer: object   # transformers' tokenizer, padding on the left; None where the layout has none


def open_on_rank(folder: Path, dtype: str | None, policy: Policy, world: World, drafting: bool) -> Opened:
    """The layout in folder on this rank's device, refused before anything loads where its model's
    cache cannot do what K/V offload, micro-batches or a draft (drafting) asks of it."""
    layout = open_layout(folder, dtype)
    kv_option = ("kv_offload" if policy.kv_offload > 0 else "kv_bits" if policy.kv_bits < 16
                 else "micro_batches" if policy.micro_batches > 1 else None)
    if kv_option or drafting:
        refuse_what_its_cache_cannot_do(AutoConfig.from_pretrained(layout.side_folder), kv_option, drafting)
    device = rank_device(policy, world)
    device.adopt_thread()  # what transformers allocates on "cuda" lands on the model's GPU, not GPU 0
    return Opened(layout, device, load_tokenizer(layout.side_folder))
