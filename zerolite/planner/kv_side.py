"""Where a batch's K/V lives, who attends over it, and in how many micro-batches a pass over the
weights serves the batch: for one policy of the weights, the options worth pricing.

    room = Room(costs, hardware, job, placements(hardware, pins.kv_offload, pins.kv_disk))
    candidates, least, lacking = kv_sides(costs, hardware, candidate, pins, room)

At fixed weight tiers a step is never quicker for moving K/V off the device, or to disk, or for
more micro-batches (each moves the same bytes or more, or splits the same work into smaller
matmuls); each only makes room. So for each count of micro-batches and each attention place,
the one placement worth pricing is the first that fits, in order of what leaves the device
(host memory before disk); and past the first count at which everything fits on the device, more
micro-batches cannot win. Attention over the K/V off a GPU is priced both ways (--kv-attention
auto: copied to the GPU, or on the CPU where it lives); the search keeps the quicker, and generate
takes its choice (zerolite.cli.generate_command).
"""

from __future__ import annotations

import dataclasses

from zerolite.planner.cost import Candidate, Job, batch_memory, weight_memory
from zerolite.planner.hardware import Hardware
from zerolite.planner.model_costs import ModelCosts

MICRO_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
KV_OFFLOADS = (0.0, 0.25, 0.5, 0.75, 1.0)   # of the layers' K/V, in host memory (GPU)
KV_DISKS = (0.0, 0.25, 0.5, 0.75, 1.0)      # ... on disk
KV_ATTENTION_PINS = ("auto", "device", "cpu")


class Room:
    """What a batch's K/V and activations take for each placement (whatever the weights do), kept
    across the search's many weight policies: by (batch, bits, attention place, micro-batches), a
    list of (host share, disk share, host bytes, GPU bytes) in placements' order."""

    def __init__(self, costs: ModelCosts, hardware: Hardware, job: Job, pairs: list[tuple[float, float]]):
        self.costs, self.hardware, self.job, self.pairs = costs, hardware, job, pairs
        self._kept: dict[tuple, list[tuple[float, float, float, float]]] = {}

    def needs(self, batch: int, bits: int, place: str, n: int) -> list[tuple[float, float, float, float]]:
        key = batch, bits, place, n
        if key not in self._kept:
            rows = []
            for host, disk in self.pairs:
                c = Candidate("stored", batch, 0, kv_offload=host, kv_bits=bits, kv_disk=disk, kv_attention=place,
                              micro_batches=n)
                rows.append((host, disk, *batch_memory(self.costs, self.hardware, c, self.job)))
            self._kept[key] = rows
        return self._kept[key]


def placements(hardware: Hardware, kv_offload: float | None, kv_disk: float | None) -> list[tuple[float, float]]:
    """(host share, disk share) pairs allowed, in the order they take K/V off the device: the
    fewest layers off it first, host memory before disk."""
    offloads = [kv_offload] if kv_offload is not None else (KV_OFFLOADS if hardware.gpu else [0.0])
    disks = [kv_disk] if kv_disk is not None else KV_DISKS
    pairs = [(h, d) for h in offloads for d in disks if h + d <= 1.0 + 1e-9]
    return sorted(pairs, key=lambda p: (p[0] + p[1], p[1]))


def kv_sides(costs: ModelCosts, hardware: Hardware, c: Candidate, pins,
             room: Room) -> tuple[list[Candidate], Candidate, float]:
    """(c with the K/V placements, attention places and micro-batch counts worth pricing, the one
    of them that needs least, and the bytes it lacks: 0 where some fit). pins: the search's Pins
    (kv_attention, micro_batches; room's placements hold its kv_offload and kv_disk)."""
    held_host, held_gpu = weight_memory(costs, hardware, c)
    streamed = costs.layers - c.gpu_layers
    if hardware.gpu and costs.experts and streamed and pins.experts not in ("device", "routed", "whole"):
        # the least a mixture's weights can take: every streamed layer's experts on the CPU, dense parts in the ring
        held_host, held_gpu = weight_memory(costs, hardware, dataclasses.replace(c, cpu_expert_layers=streamed))
    host_room, gpu_room = hardware.host_ram - held_host, hardware.gpu_ram - held_gpu if hardware.gpu else 0
    counts = [pins.micro_batches] if pins.micro_batches else [n for n in MICRO_BATCHES if n <= c.batch_size]
    attention = pins.kv_attention if pins.kv_attention not in (None, "auto") else None
    places = [attention] if attention else (["device", "cpu"] if hardware.gpu else ["device"])
    chosen, least, least_over = [], None, None
    for place in places:
        if host_room < 0 or gpu_room < 0:
            counts = counts[-1:]  # the weights alone do not fit: the least the batch can need, for the message
        last = None  # the placement chosen at fewer micro-batches: at more, the same one only runs slower
        for n in counts:
            for host, disk, kv_host, kv_gpu in room.needs(c.batch_size, c.kv_bits, place, n):
                if place == "cpu" and host + disk == 0:
                    continue  # nothing off the GPU to attend over on the CPU: the device's option
                over = max(kv_host - host_room, 0) + max(kv_gpu - gpu_room, 0)
                if over <= 0:
                    if (host, disk) != last:
                        chosen.append((n, host, disk, place))
                    last = host, disk
                    break
                if least_over is None or over < least_over:
                    least, least_over = (n, host, disk, place), over
            if last == (0.0, 0.0):
                break  # everything fits on the device: more micro-batches only slow the step

    def made(n: int, host: float, disk: float, place: str) -> Candidate:
        return dataclasses.replace(c, micro_batches=n, kv_offload=host, kv_disk=disk, kv_attention=place)

    if not chosen:
        return [], made(*least), least_over
    fitting = [made(*option) for option in chosen]
    return fitting, fitting[0], 0
