"""What happened when: spans on named tracks, for `zerolite profile` and its trace and picture.

    timeline = Timeline()
    with timeline.span("compute", "layers.3"):
        ...
    timeline.add("read", "layers.4", submitted, finished, bytes=n)   # times from the engine

Times are time.perf_counter() seconds, the clock the I/O engine reports completions on. Work
queued on a CUDA stream is timed with CUDA events and turned into host times once the GPU is done
with it (resolve()). When nothing profiles, the executor holds NO_TIMELINE, whose span() hands
back one shared do-nothing context manager: nothing is measured or stored on the hot path.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

TRACKS = ("step", "read", "copy", "wait", "compute")


@dataclass(frozen=True)
class Span:
    track: str      # one of TRACKS
    name: str       # a block name, or "step N"
    start: float    # perf_counter seconds
    end: float
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    enabled = True

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._gpu: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event, dict]] = []
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def add(self, track: str, name: str, start: float, end: float, **args) -> None:
        self.spans.append(Span(track, name, start, end, args))

    @contextmanager
    def span(self, track: str, name: str, stream: torch.cuda.Stream | None = None, **args):
        """Times the body on the host, or, given a CUDA stream, the work the body queues on it."""
        if stream is None:
            start = time.perf_counter()
            yield
            self.add(track, name, start, time.perf_counter(), **args)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self._anchor is None:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(stream)
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())
        begin.record(stream)
        yield
        end.record(stream)
        self._gpu.append((track, name, begin, end, args))

    def resolve(self) -> None:
        """Turns CUDA event pairs into spans on the host clock (waits for the GPU)."""
        if not self._gpu:
            return
        anchor, anchor_s = self._anchor
        for track, name, begin, end, args in self._gpu:
            end.synchronize()
            start = anchor_s + anchor.elapsed_time(begin) / 1e3
            self.add(track, name, start, start + begin.elapsed_time(end) / 1e3, **args)
        self._gpu = []

    def on(self, track: str) -> list[Span]:
        return sorted((s for s in self.spans if s.track == track), key=lambda s: s.start)


class _NoTimeline:
    """Stands in for a Timeline when nothing profiles: records nothing, costs one call."""

    enabled = False
    _nothing = nullcontext()

    def add(self, *args, **kwargs) -> None:
        pass

    def span(self, *args, **kwargs):
        return self._nothing


NO_TIMELINE = _NoTimeline()
