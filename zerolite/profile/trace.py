"""A timeline for people: Chrome trace JSON (Perfetto, chrome://tracing) and a PNG picture.

One track each for steps, reads, the host's waits for reads (on a GPU), copies, compute's waits,
compute and a draft's guesses, in that order, time in milliseconds from the first span.
"""

from __future__ import annotations

import json
from pathlib import Path

from zerolite.errors import ZeroliteError
from zerolite.runtime.timeline import TRACKS, Timeline

TRACK_LABELS = {"step": "steps", "read": "reads (disk)", "read wait": "host waits for reads", "copy": "copies (to GPU)",
                "wait": "compute waits", "compute": "compute", "draft": "draft (guesses)"}
COLOURS = {"step": "#9e9e9e", "read": "#1f77b4", "read wait": "#ff7f0e", "copy": "#9467bd", "wait": "#d62728",
           "compute": "#2ca02c", "draft": "#e377c2"}


def chrome_trace(timeline: Timeline) -> dict:
    """Complete ("X") events in microseconds, a thread per track, named by metadata events."""
    origin = min((s.start for s in timeline.spans), default=0.0)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "zerolite"}},
        *(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": TRACK_LABELS[track]}}
            for tid, track in enumerate(TRACKS)
        ),
    ]
    for span in timeline.spans:
        events.append({
            "name": span.name, "cat": span.track, "ph": "X", "pid": 1, "tid": TRACKS.index(span.track),
            "ts": round((span.start - origin) * 1e6, 3), "dur": round(span.duration * 1e6, 3), "args": span.args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timeline: Timeline, path: Path) -> None:
    path.write_text(json.dumps(chrome_trace(timeline)))


def plot_timeline(timeline: Timeline, path: Path, title: str, subtitle: str, last_steps: int = 3) -> None:
    """The last few steps as lanes of bars: where reads, copies, waits and compute overlap, and where not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ZeroliteError("--plot needs matplotlib: "
                            "pip install 'zerolite[plot]' (or pip install matplotlib)") from None
    steps = timeline.on("step")[-last_steps:]
    if not steps:
        raise ZeroliteError("nothing ran, so there is nothing to plot")
    start, end = steps[0].start, steps[-1].end
    lanes = [track for track in TRACKS if timeline.on(track)]
    figure, axes = plt.subplots(figsize=(13, 1.0 + 0.6 * len(lanes)), dpi=110)
    for row, track in enumerate(reversed(lanes)):
        spans = [s for s in timeline.on(track) if s.end > start and s.start < end]
        bars = [((s.start - start) * 1e3, s.duration * 1e3) for s in spans]
        shades = [COLOURS[track] if k % 2 == 0 else lighter(COLOURS[track]) for k in range(len(bars))]
        axes.broken_barh(bars, (row + 0.15, 0.7), facecolors=shades, edgecolor="white", linewidth=0.4)
        if track in ("step", "compute") and len(spans) <= 40:
            for s in spans:
                width = s.duration * 1e3
                if width > (end - start) * 1e3 / 40:
                    axes.text((s.start - start) * 1e3 + width / 2, row + 0.5, s.name.removeprefix("layers."),
                              ha="center", va="center", fontsize=7, color="white")
    axes.set_yticks([row + 0.5 for row in range(len(lanes))], [TRACK_LABELS[t] for t in reversed(lanes)])
    axes.set_xlim(0, (end - start) * 1e3)
    axes.set_xlabel("milliseconds")
    axes.set_title(f"{title}\n{subtitle}", fontsize=10, loc="left")
    axes.grid(axis="x", alpha=0.3)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def lighter(colour: str) -> str:
    """Alternate bars in a lane a shade lighter, so neighbouring blocks stay apart."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{(c + 255) // 2:02x}" for c in rgb)
