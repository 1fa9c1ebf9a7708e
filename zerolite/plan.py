"""Where each block lives while the model runs: a pure value, computed from the policy, the budgets
and the layout.

Three tiers, fastest first. Resident blocks are bound once and stay on the device. The other
layers stream through the ring of slots every forward, from host memory (pinned on CUDA) when the
host budget holds them, else from the layout on disk.

Layers kept in a faster tier are spread evenly over the model rather than taken from its front: a
disk read then always has another layer's compute to hide under, instead of the disk idling
through a run of layers held in memory and then being waited on through the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.budget import Budgets
from zerolite.manifest import Manifest
from zerolite.policy import Policy


@dataclass(frozen=True)
class Plan:
    resident: tuple[str, ...]   # bound once, on the device
    streamed: tuple[str, ...]   # through the slots, in layer order
    on_disk: tuple[str, ...]    # the streamed blocks read from the layout at every forward

    @classmethod
    def make(cls, manifest: Manifest, policy: Policy, budgets: Budgets) -> Plan:
        """The embeddings, the head and the final norm run at every step and are small beside the
        layers: always resident. Layers go to the device while its budget lasts, then (with
        --offload nvme) to host memory while that budget lasts; the rest stay on disk."""
        names = [block.name for block in manifest.blocks]
        if policy.offload == "none":
            return cls(tuple(names), (), ())
        layers = [name for name in names if name.startswith("layers.")]
        always = [name for name in names if name not in layers]
        widest = max((manifest.block(name).length for name in layers), default=1)

        on_device_room = budgets.device - sum(manifest.block(name).length for name in always)
        on_device = spread(layers, on_device_room // widest)
        rest = [name for name in layers if name not in on_device]
        in_memory = rest if policy.offload == "cpu" else spread(rest, budgets.host // widest)
        resident = tuple(name for name in names if name in always or name in on_device)
        return cls(resident, tuple(rest), tuple(name for name in rest if name not in in_memory))

    @property
    def in_memory(self) -> tuple[str, ...]:
        """The streamed blocks whose home is host memory."""
        return tuple(name for name in self.streamed if name not in self.on_disk)

    @property
    def loaded(self) -> tuple[str, ...]:
        """Blocks read while loading: the resident ones and those held in host memory."""
        return self.resident + self.in_memory


def spread(names: list[str], count: int) -> list[str]:
    """count of names, evenly spaced over the list (all of them when count reaches its length)."""
    count = max(min(count, len(names)), 0)
    return [names[(2 * j + 1) * len(names) // (2 * count)] for j in range(count)]
