"""The --output file of `zerolite generate`: appended batch by batch, durable, resumable, one writer.

    with CompletionLog.open(path) as log:     # refuses a second writer; drops a torn last line
        todo = [p for p in prompts if p.id not in log.done]
        log.append(completions)               # whole lines, flushed and fsynced before it returns

A run killed at any moment leaves whole lines for every batch it finished, and at worst a torn
tail of the batch it was writing, which the next run cuts off before appending. Rerun with the same
arguments, it does what is missing, so every id ends in the file once.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from zerolite.errors import ZeroliteError
from zerolite.generate.prompts import Completion


class CompletionLog:
    def __init__(self, path: Path, handle, done: set):
        self.path = path
        self._handle = handle
        self.done = done

    @classmethod
    def open(cls, path: Path) -> CompletionLog:
        try:
            handle = open(path, "a+b")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise ZeroliteError(f"cannot write `output` {path}: {e.strerror}; choose a file you can write") from e
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ZeroliteError(f"another zerolite is writing `output` {path}: wait for it to finish "
                                "or choose another file") from None
        try:
            done = cut_torn_tail_and_read_ids(handle, path)
        except ZeroliteError:
            handle.close()
            raise
        return cls(path, handle, done)

    def append(self, completions: list[Completion]) -> None:
        """Adds the completions not yet in the file, as whole lines, durably."""
        lines = [c.to_json() + "\n" for c in completions if c.id not in self.done]
        if not lines:
            return
        self._handle.write("".join(lines).encode())
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self.done.update(c.id for c in completions)

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> CompletionLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cut_torn_tail_and_read_ids(handle, path: Path) -> set:
    handle.seek(0)
    data = handle.read()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):  # a write cut short by a crash: its line is redone
        handle.truncate(len(whole))
        handle.flush()
        os.fsync(handle.fileno())
    done = set()
    for number, line in enumerate(whole.splitlines(), start=1):
        try:
            record = json.loads(line)
            done.add(record["id"])
        except (ValueError, KeyError, TypeError):
            raise ZeroliteError(
                f"`output` {path} line {number} is not a zerolite completion: it is another file; "
                "choose another `output`"
            ) from None
    return done
