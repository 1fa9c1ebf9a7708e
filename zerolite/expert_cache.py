"""Experts kept in host memory across steps, so that a popular expert is read from disk once.

    cache = ExpertCache(budget_bytes, allocate=device.pinned_empty)
    cache.get(("layers.3", 5))            # its bytes, or None
    cache.put(("layers.3", 5), host_bytes)  # copied in; the least recently used give way

The budget is what the host budget leaves after the layers held there whole (Plan.expert_cache).
A hit costs a copy from host memory (on a GPU, a pinned host-to-device copy) instead of a disk read.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[str, int]  # (block, expert)


class ExpertCache:
    def __init__(self, budget_bytes: int, allocate):
        self.budget_bytes = budget_bytes
        self.allocate = allocate
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self._held = 0

    def get(self, key: Key) -> torch.Tensor | None:
        """The expert's bytes if held (it becomes the most recently used); counts a hit or a miss."""
        data = self._entries.get(key)
        if data is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return data

    def put(self, key: Key, data: torch.Tensor) -> None:
        """Keeps a copy of the expert's bytes, reusing the buffer of the least recently used one
        it pushes out; does nothing when the budget holds not even this one."""
        nbytes = data.numel()
        if nbytes > self.budget_bytes or key in self._entries:
            return
        buffer = None
        while self._held + nbytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._held -= evicted.numel()
            if evicted.numel() == nbytes:
                buffer = evicted
        buffer = self.allocate(nbytes) if buffer is None else buffer
        buffer.copy_(data)
        self._entries[key] = buffer
        self._held += nbytes

    @property
    def hit_rate(self) -> float | None:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else None
