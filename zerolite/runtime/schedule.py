"""The order streamed blocks run in, so that the executor can read ahead of compute.

The first forward is assumed to run the blocks in layer order; every forward records the order
they really ran in (the trace), and the next one looks ahead along that. A model that runs its
layers in another order, skips or repeats some costs at most one forward of wrong guesses.
"""

from __future__ import annotations


class Schedule:
    def __init__(self, guess: list[str]):
        self.order = list(guess)
        self._trace: list[str] = []
        self._position = {name: i for i, name in enumerate(self.order)}

    def ran(self, name: str) -> None:
        self._trace.append(name)

    def end_forward(self) -> None:
        """Makes the order just traced the one to look ahead along."""
        if self._trace and self._trace != self.order:
            self.order = self._trace
            self._position = {}
            for i, name in enumerate(self.order):
                self._position.setdefault(name, i)
        self._trace = []

    def _where(self, name: str) -> int | None:
        """name's place in the order: where this forward has got to when it runs there as expected
        (right even for a block that runs twice per forward), else its first place."""
        here = len(self._trace) - 1
        if 0 <= here < len(self.order) and self.order[here] == name:
            return here
        return self._position.get(name)

    def ahead(self, name: str, count: int, among: frozenset[str] | None = None) -> list[str]:
        """The count blocks expected after name (only those in among, when given), wrapping into
        the next forward (the next token's first blocks are read while this token's last ones and
        the head compute)."""
        start = self._where(name)
        if start is None or count <= 0:
            return []
        upcoming = []
        for step in range(1, len(self.order)):
            candidate = self.order[(start + step) % len(self.order)]
            if candidate != name and candidate not in upcoming and (among is None or candidate in among):
                upcoming.append(candidate)
            if len(upcoming) == count:
                break
        return upcoming
