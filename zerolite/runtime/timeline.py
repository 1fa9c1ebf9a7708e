"""What happened when: spans on named tracks, for `zerolite profile` and its trace and picture.

    timeline = Timeline()
    with timeline.span("compute", "layers.3"):
        ...
    timeline.add("read", "layers.4", submitted, finished, bytes=n)   # times from the engine

Times are time.perf_counter() seconds, the clock the I/O engine reports completions on. Work
queued on a device stream is timed with the device's events and put on that same host clock once
the device is done with it (resolve()), so that every span is on one clock before it is attributed
to a step. When nothing profiles, the executor holds NO_TIMELINE, whose span() hands
back one shared do-nothing context manager: nothing is measured or stored on the hot path.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

TRACKS = ("step", "read", "read wait", "copy", "wait", "compute", "draft")
""""wait" is compute waiting for a block's bytes (on a GPU, the device-side stall, the device's idle
while the host waits for the disk included); "read wait" is the host waiting for the disk, on a
GPU, where the host queues compute and does not compute;
"draft" is a speculative draft guessing the tokens the next step checks (zerolite.speculative.decoding)."""


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
        self.device = None  # the Device whose streams spans may be timed on (set by the executor)
        self._queued: list[tuple[str, str, object, object, dict]] = []
        self._anchor: tuple[object, float] | None = None

    def add(self, track: str, name: str, start: float, end: float, **args) -> None:
        self.spans.append(Span(track, name, start, end, args))

    @contextmanager
    def span(self, track: str, name: str, stream=None, **args):
        """Times the body on the host, or, given a stream of a device with memory of its own, the
        work the body queues on that stream."""
        if stream is None or self.device is None or not self.device.separate_memory:
            start = time.perf_counter()
            yield
            self.add(track, name, start, time.perf_counter(), **args)
            return
        if self._anchor is None:
            anchor = self.device.record(stream, timing=True)
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())
        begin = self.device.record(stream, timing=True)
        yield
        end = self.device.record(stream, timing=True)
        self._queued.append((track, name, begin, end, args))

    def resolve(self) -> None:
        """Turns device event pairs into spans on the host clock (waits for the device)."""
        if not self._queued:
            return
        anchor, anchor_s = self._anchor
        for track, name, begin, end, args in self._queued:
            end.synchronize()
            start = anchor_s + anchor.elapsed_time(begin) / 1e3
            self.add(track, name, start, start + begin.elapsed_time(end) / 1e3, **args)
        self._queued = []

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
