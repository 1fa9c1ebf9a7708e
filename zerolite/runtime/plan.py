"""Where each block lives while the model runs: a pure value, computed from the policy, the budgets
and the layout.

Three tiers, fastest first. Resident blocks are bound once and stay on the device. The other
layers stream through the ring of slots every forward, from host memory (pinned on a GPU) when the
host budget holds them, else from the layout on disk.

On a GPU the device's tier takes layers spread among the streamed ones, so that the copy engine
always has a streamed layer to fetch while resident ones compute: the ring reads ahead only
prefetch_depth - 1 blocks that need a transfer, and a run of resident layers that computes longer
than those copies take leaves the link idle (tests/test_timed_device.py).
Elsewhere (a CPU, whose device tier is host memory, and a mixture's layers read per expert) the
device's tier takes the first layers. Host memory's takes the next streamed ones. Where the device computes from
host memory (a CPU), the layers read from disk are spread evenly among those held there, so that
the disk reads the next one while the held ones between compute: the executor reads ahead counting
only blocks that need a transfer, and a ring of a few slots cannot cover a long run of held layers
(the disk would idle through them).
Where host memory is apart from the device's (a GPU), host-tier layers take slots and copies too,
and the disk's layers stay one contiguous stretch of the layout, read in order into staging
buffers apart from the ring as soon as one is free, from the step before (zerolite.runtime.slots):
spread among the held ones with the ring's own two host buffers, each read would wait for the copy
out of its buffer. So do a mixture's layers read per expert, each of which guesses the next one's
experts (zerolite.moe.routing). The figures behind each choice: docs/design-figures.md, under
zerolite/runtime/plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.layout.manifest import Manifest
from zerolite.runtime.budget import Budgets
from zerolite.runtime.policy import Policy


@dataclass(frozen=True)
class Plan:
    resident: tuple[str, ...]   # bound once, on the device
    streamed: tuple[str, ...]   # through the slots, in layer order
    on_disk: tuple[str, ...]    # the streamed blocks read from the layout at every forward
    expert_cache: int = 0       # bytes of host memory keeping experts read from disk across steps

    @classmethod
    def make(cls, manifest: Manifest, policy: Policy, budgets: Budgets, host_cost=lambda nbytes: nbytes,
             ranks_here: int = 1, dense=lambda name: 0, separate_memory: bool = False) -> Plan:
        """The embeddings, the head and the final norm run at every step and are small beside the
        layers: always resident. Layers go to the device while its budget lasts, then (with
        --offload nvme) to host memory while that budget lasts; the rest stay on disk, after the
        held ones or spread among them (the module's docstring says where).

        host_cost(nbytes) is the host memory a layer of nbytes really takes there (pinned memory
        is rounded: Device.pinned_cost). ranks_here share the node's layers in host memory, but
        each keeps experts of its own: the expert cache is split between them. dense(name) is what
        a block resident on the device takes beyond its stored bytes (a GPU keeps quantized
        weights dequantised there: zerolite.quant.linear.dense_bytes). separate_memory: the
        device's memory is apart from the host's (Device.separate_memory)."""
        names = [block.name for block in manifest.blocks]
        if policy.offload == "none":
            return cls(tuple(names), (), ())
        layers = list(manifest.layer_names)
        always = [name for name in names if name not in layers]
        widest = max((manifest.block(name).length for name in layers), default=1)
        widest_on_device = widest + max((dense(name) for name in layers), default=0)

        on_device_room = budgets.device - manifest.nbytes(always) - sum(dense(name) for name in always)
        fits = min(max(on_device_room // widest_on_device, 0), len(layers))
        # Experts read per expert guess the next layer's from this one's: those layers stay together.
        per_expert = policy.per_expert and any(manifest.block(name).experts for name in layers)
        if separate_memory and not per_expert:
            streams = set(spread(layers, len(layers) - fits))
            on_device = [name for name in layers if name not in streams]
        else:
            on_device = layers[:fits]
        rest = [name for name in layers if name not in on_device]
        held = len(rest) if policy.offload == "cpu" else min(budgets.host // host_cost(widest), len(rest))
        resident = tuple(name for name in names if name in always or name in on_device)
        on_disk = tuple(rest[held:] if separate_memory or per_expert else spread(rest, len(rest) - held))
        # What the layers held whole leave of the host budget keeps experts read from disk instead.
        routed = policy.per_expert and any(manifest.block(name).experts for name in on_disk)
        cache = (budgets.host - held * host_cost(widest)) // ranks_here if routed else 0
        return cls(resident, tuple(rest), on_disk, max(cache, 0))

    @property
    def in_memory(self) -> tuple[str, ...]:
        """The streamed blocks whose home is host memory."""
        return tuple(name for name in self.streamed if name not in self.on_disk)

    def in_host(self, separate_memory: bool) -> tuple[str, ...]:
        """The blocks whose bytes host memory holds while the model runs: the layers kept there
        and, where host memory is the device's, the resident blocks too. A node's ranks share one
        copy of them (zerolite.distributed.node_copy)."""
        return self.in_memory + (() if separate_memory else self.resident)

    @property
    def loaded(self) -> tuple[str, ...]:
        """Blocks read while loading: the resident ones and those held in host memory."""
        return self.resident + self.in_memory


def spread(items: list, count: int) -> list:
    """count of items, evenly spaced over the list (all of them when count reaches its length)."""
    count = max(min(count, len(items)), 0)
    return [items[(2 * j + 1) * len(items) // (2 * count)] for j in range(count)]
