"""Progress bars for long work, on stderr so that stdout stays the program's answer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

stderr = Console(stderr=True)


class ByteProgress:
    """Counts bytes and the items (blocks) they belong to."""

    def __init__(self, progress: Progress | None, task):
        self._progress, self._task = progress, task
        self.items = 0

    def advance(self, nbytes: int, items: int = 1) -> None:
        self.items += items
        if self._progress is not None:
            self._progress.update(self._task, advance=nbytes, blocks=self.items)


@contextmanager
def byte_progress(description: str, total_bytes: int, total_items: int, enabled: bool = True) -> Iterator[ByteProgress]:
    """A bar showing blocks done, bytes done, speed and time left (GB/s, decimal units).

    Only on a terminal: piped into a log, stderr carries just the messages that matter.
    """
    if not (enabled and stderr.is_terminal):
        yield ByteProgress(None, None)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[blocks]}/{task.fields[total_blocks]} blocks"),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr, transient=False) as progress:
        task = progress.add_task(description, total=total_bytes, blocks=0, total_blocks=total_items)
        yield ByteProgress(progress, task)
