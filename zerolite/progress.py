"""Progress bars for long work, on stderr so that stdout stays the program's answer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

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
def terminal_bar(columns, description: str, total: int, enabled: bool, **fields):
    """(progress, task) of a rich bar on stderr, or (None, None) when disabled or not on a terminal:
    piped into a log, stderr carries just the messages that matter."""
    if not (enabled and stderr.is_terminal):
        yield None, None
        return
    with Progress(*columns, console=stderr, transient=False) as progress:
        yield progress, progress.add_task(description, total=total, **fields)


@contextmanager
def byte_progress(description: str, total_bytes: int, total_items: int, enabled: bool = True) -> Iterator[ByteProgress]:
    """A bar showing blocks done, bytes done, speed and time left (GB/s, decimal units)."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[blocks]}/{task.fields[total_blocks]} blocks"),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with terminal_bar(columns, description, total_bytes, enabled, blocks=0, total_blocks=total_items) as bar:
        yield ByteProgress(*bar)


@contextmanager
def measuring(what: str) -> Iterator[None]:
    """A line on stderr while the machine is measured before a run's first line, naming what is
    measured and for how long: a first plan once spent a silent minute and a half measuring."""
    columns = (SpinnerColumn(finished_text="[green]done[/green]"), TextColumn("measuring {task.description}"),
               TimeElapsedColumn())
    with terminal_bar(columns, what, 1, True) as (progress, task):
        yield
        if progress is not None:
            progress.update(task, completed=1)


class TokenRateColumn(ProgressColumn):
    """Tokens per second over the last few seconds (rich keeps the samples)."""

    def render(self, task) -> Text:
        rate = f"{task.speed:.1f}" if task.speed else "-"
        return Text(f"{rate} tokens/s", style="progress.data.speed")


class TokenProgress:
    """Counts generated tokens; the bar shows them against the most the run can make."""

    def __init__(self, progress: Progress | None, task):
        self._progress, self._task = progress, task

    def advance(self, tokens: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=tokens)

    def note(self, text: str) -> None:
        """A short status after the bar, e.g. which batch is running."""
        if self._progress is not None:
            self._progress.update(self._task, note=text)


@contextmanager
def token_progress(description: str, total_tokens: int, enabled: bool = True) -> Iterator[TokenProgress]:
    """A bar of tokens generated with live tokens/s."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TokenRateColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
    )
    with terminal_bar(columns, description, total_tokens, enabled, note="") as bar:
        yield TokenProgress(*bar)
