"""Where each block lives while the model runs: a pure value, computed from the policy and the layout.

Resident blocks are bound once and stay on the device. Streamed blocks pass through the ring of
slots every forward, from their home: the layout on disk ("nvme") or host memory ("cpu").
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.manifest import Manifest
from zerolite.policy import Policy


@dataclass(frozen=True)
class Plan:
    resident: tuple[str, ...]   # bound once, on the device
    streamed: tuple[str, ...]   # through the slots, in layer order
    home: str                   # where streamed blocks are read from: "nvme" or "cpu"

    @classmethod
    def make(cls, manifest: Manifest, policy: Policy) -> Plan:
        """Decoder layers stream; the embeddings and the head are small beside them and run at
        every step, so they stay resident. With offload "none" everything does."""
        names = [block.name for block in manifest.blocks]
        if policy.offload == "none":
            return cls(tuple(names), (), "cpu")
        streamed = tuple(name for name in names if name.startswith("layers."))
        resident = tuple(name for name in names if name not in streamed)
        return cls(resident, streamed, policy.offload)

    @property
    def loaded(self) -> tuple[str, ...]:
        """Blocks read while loading: the resident ones, and the streamed ones when their home is memory."""
        return self.resident + (self.streamed if self.home != "nvme" else ())
