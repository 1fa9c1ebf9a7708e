"""Reading the next block while this one is quantized and written.

    for block, tensors in read_ahead(iter_block_tensors(...)):
        ...   # the next item is being produced meanwhile, on a thread of its own

Converting is three waits in a row, the read, the quantizing and the write; a thread that pulls
the next item from the source while the caller works on this one overlaps the read with the
rest. It runs at most `depth` items ahead (memory holds the caller's item and those), and the
source runs only on that thread, so a generator using scratch state of its own stays safe. The
source's error reaches the caller at the item it failed on; a caller that stops early stops the
thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

Item = TypeVar("Item")
_END = object()


def read_ahead(source: Iterable[Item], depth: int = 1) -> Iterator[Item]:
    ready: queue.Queue = queue.Queue()
    room = threading.Semaphore(depth)   # one per item that may be produced before the caller takes it
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in source:
                if not wait_for_room(room, stop):
                    return
                ready.put((item, None))
            ready.put((_END, None))
        except BaseException as error:  # noqa: BLE001  (handed to the caller, who raises it)
            ready.put((_END, error))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="zerolite-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
            room.release()
    finally:
        stop.set()
        room.release()  # a producer waiting for room wakes, sees stop, and ends
        thread.join()


def wait_for_room(room: threading.Semaphore, stop: threading.Event) -> bool:
    room.acquire()
    return not stop.is_set()
