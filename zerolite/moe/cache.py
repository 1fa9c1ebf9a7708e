"""Experts kept in host memory across steps, so that a popular expert is read from disk once.

    cache = ExpertCache(budget_bytes, allocate=aligned_empty)
    cache.get(("layers.3", 5))              # its bytes, or None; counts a use of the expert either way
    cache.put(("layers.3", 5), host_bytes)  # copied in, if it is used more than the least used one held

Kept by how often each expert has been used, not by how recently: a step visits the layers in
order, so least-recently-used keeps exactly the experts about to go unused longest, and a cache
smaller than one step's experts would never hit. Routers favour some experts over others; those
stay (the frequency-aware caching of MoE-Infinity). The budget is what the host budget leaves
after the layers held there whole (Plan.expert_cache). A hit costs a copy from host memory (on a
GPU, then the pinned host-to-device copy) instead of a disk read.
"""

from __future__ import annotations

from collections import Counter

import torch

Key = tuple[str, int]  # (block, expert)


class ExpertCache:
    def __init__(self, budget_bytes: int, allocate):
        self.budget_bytes = budget_bytes
        self.allocate = allocate
        self.hits = 0
        self.misses = 0
        self._uses: Counter[Key] = Counter()  # of every expert asked for, held or not
        self._entries: dict[Key, torch.Tensor] = {}
        self._held = 0

    def get(self, key: Key) -> torch.Tensor | None:
        self._uses[key] += 1
        data = self._entries.get(key)
        if data is None:
            self.misses += 1
        else:
            self.hits += 1
        return data

    def put(self, key: Key, data: torch.Tensor) -> None:
        """Keeps a copy of the expert's bytes while the budget has room; once full, in place of the
        least used expert held, if this one has been used more (reusing its buffer)."""
        nbytes = data.numel()
        if key in self._entries:
            return
        buffer = None
        if self._held + nbytes > self.budget_bytes:
            if not self._entries:
                return
            least = min(self._entries, key=self._uses.__getitem__)
            if (self._uses[least] >= self._uses[key]
                    or self._held - self._entries[least].numel() + nbytes > self.budget_bytes):
                return
            buffer = self._entries.pop(least)
            self._held -= buffer.numel()
            if buffer.numel() != nbytes:
                buffer = None
        buffer = self.allocate(nbytes) if buffer is None else buffer
        buffer.copy_(data)
        self._entries[key] = buffer
        self._held += nbytes
