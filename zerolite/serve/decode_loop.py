"""The decode loop of zerolite serve: the one thread that calls the model while serving.

    decode_loop = DecodeLoop(lm, max_batch=16, max_queue=64, step_tokens=None, metrics=metrics)  # None: auto
    decode_loop.start()
    decode_loop.submit(Request(sequences, asyncio.get_running_loop()))   # from the web server's loop
    event = await request.events.get()                                     # Tokens, Finished or Failed

Each turn of the loop (the Decoder's, which generate's input files turn too):
1. drops the sequences whose clients went away, waiting or running;
2. lets waiting sequences join the running batch, up to max_batch (a step boundary);
3. runs one step: one pass over the weights for every row, prefill chunks and decodes alike;
4. sends each row's next token to its client, and lets the rows that are done leave.

Requests arrive on the web server's event loop and hear back through it: the decode loop posts
events with call_soon_threadsafe, and reads nothing of the requests but their cancelled flag.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from zerolite.decoding.decoder import Advance, Decoder, Sequence
from zerolite.errors import describe
from zerolite.serve.metrics import ServeMetrics


@dataclass(frozen=True)
class Tokens:
    index: int            # the choice this is for
    token_ids: list[int]
    text: str             # may be empty: a character or a possible stop string still incomplete


@dataclass(frozen=True)
class Finished:
    index: int
    reason: str           # "stop" (end token or stop string) or "length"


@dataclass(frozen=True)
class Failed:
    message: str
    status: int           # the HTTP status it would have been: 500 for a failed step, 503 when shutting down
    code: str             # OpenAI's error code: "internal_error" or "shutting_down"


class Request:
    """One HTTP request's sequences, and the queue their events come back on."""

    def __init__(self, sequences: list[Sequence], loop: asyncio.AbstractEventLoop):
        self.sequences = sequences
        for sequence in sequences:
            sequence.request = self
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.cancelled = False
        self.arrived = time.monotonic()
        self.answered = False        # its first token has been sent

    def post(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the web server's loop is closed: nobody is left to hear it

    def cancel(self) -> None:
        """The client went away: its sequences leave at the next step boundary."""
        self.cancelled = True


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


class DecodeLoop:
    def __init__(self, lm, max_batch: int, max_queue: int, step_tokens: int | None, metrics: ServeMetrics):
        """step_tokens: the most tokens a step computes over the batch; None: as many as hide
        under the step's reads (zerolite.decoding.step_budget)."""
        self.lm = lm
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.decoder = Decoder(lm, max_batch, step_tokens)
        self.batch = self.decoder.batch
        self._waiting = self.decoder.waiting
        self._wake = threading.Condition()
        self._accepting = True
        self._deadline: float | None = None    # while draining: when what is left is cancelled
        self._stopped = False
        self._step_s = 1.0                      # a running average, for Retry-After
        self._thread = threading.Thread(target=self._run, name="zerolite-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._wake:
            return not self._waiting and not self.batch.rows

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive(self) -> bool:
        """The loop's thread runs (a server whose decode loop died answers /health with 503)."""
        return self._thread.is_alive()

    @property
    def capacity(self) -> int:
        """The most sequences that may be running or waiting at once."""
        return self.max_batch + self.max_queue

    def submit(self, request: Request) -> None:
        """Queues the request's sequences; raises QueueFull when more than max_queue would wait
        beyond the batch's free places, ShuttingDown once draining began."""
        with self._wake:
            if not self._accepting:
                raise ShuttingDown()
            free = self.max_batch - len(self.batch.rows)
            if len(self._waiting) + len(request.sequences) - free > self.max_queue:
                raise QueueFull(self._retry_after_s())
            self._waiting.extend(request.sequences)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()

    def wake(self) -> None:
        """A request was cancelled: an idle-looking loop takes note now rather than at its next step."""
        with self._wake:
            self._wake.notify()

    def drain(self, timeout_s: float) -> None:
        """Stops taking requests; what is in flight may finish within timeout_s, and is then
        answered with an error."""
        with self._wake:
            self._accepting = False
            self._deadline = time.monotonic() + timeout_s
            self._wake.notify()

    def close(self) -> None:
        """Answers whatever is left with an error and stops the thread."""
        with self._wake:
            self._accepting = False
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        self._fail_all(Failed("the server stopped before this request finished", 503, "shutting_down"))

    def _retry_after_s(self) -> int:
        """Seconds until the first running sequence is expected to end and free a place."""
        remaining = [s.max_tokens - len(s.generated) + math.ceil(len(r.pending) / self.batch.step_tokens)
                     for r in self.batch.rows if (s := r.owner)]
        return max(1, math.ceil(min(remaining, default=1) * self._step_s))

    def _run(self) -> None:
        self.lm.device.adopt_thread()
        while True:
            with self._wake:
                while not self._stopped and not self._waiting and not self.batch.rows:
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                self._turn()
            except Exception as e:  # a failed turn fails its rows; the server goes on with the next requests
                traceback.print_exc(file=sys.stderr)
                with self._wake:
                    self._fail_all(Failed(f"internal error in a step: {describe(e)}", 500, "internal_error"),
                                   waiting_too=False)

    def _turn(self) -> None:
        with self._wake:
            self._drop_cancelled()
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._fail_all(Failed("the server is shutting down and this request did not finish in time", 503,
                                      "shutting_down"))
                return
            self._admit()
        self._step()

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._waiting if s.request.cancelled]:
            self._waiting.remove(sequence)
            self.metrics.sequences.labels("cancelled").inc()
        leaving = [row for row in self.batch.rows if row.owner.request.cancelled]
        self.batch.remove(leaving)
        self.metrics.sequences.labels("cancelled").inc(len(leaving))
        self._count()

    def _admit(self) -> None:
        joining = self.decoder.next_joining()
        self.metrics.prompt_tokens.inc(sum(len(sequence.prompt_ids) for sequence in joining))
        try:
            self.decoder.join(joining)
        except Exception as e:
            # Neither running nor waiting now: their requests hear of it here (the running ones, whose
            # cache the half-done add left uneven, from the turn's failure).
            failure = Failed(f"internal error joining the batch: {describe(e)}", 500, "internal_error")
            for request in {sequence.request for sequence in joining}:
                request.post(failure)
            self.metrics.sequences.labels("error").inc(len(joining))
            raise
        self._count()

    def _step(self) -> None:
        started = time.perf_counter()
        advances = self.decoder.step()
        leaving = []
        failed = {}   # request -> what failed: only its own rows leave
        for advance in advances:
            request = advance.sequence.request
            if advance.error is not None:
                traceback.print_exception(advance.error, file=sys.stderr)
                failed.setdefault(request, Failed(f"internal error choosing a token: {describe(advance.error)}",
                                                  500, "internal_error"))
            elif request not in failed:
                self._send(advance)
                if advance.reason is not None:
                    leaving.append(advance.row)
        with self._wake:
            leaving += [row for row in self.batch.rows if row.owner.request in failed and row not in leaving]
            self.decoder.leave(leaving)
            self._count()
        for request, failure in failed.items():
            request.post(failure)
            self.metrics.sequences.labels("error").inc(len(request.sequences))
        seconds = time.perf_counter() - started
        self._step_s = 0.8 * self._step_s + 0.2 * seconds
        self.metrics.step(seconds, len(advances))

    def _send(self, advance: Advance) -> None:
        """Sends the row's new token to its client, and its end when it came."""
        request = advance.sequence.request
        if not request.answered:
            request.answered = True
            self.metrics.ttft.observe(time.monotonic() - request.arrived)
        request.post(Tokens(advance.sequence.index, [advance.token], advance.text))
        if advance.reason is not None:
            request.post(Finished(advance.sequence.index, advance.reason))
            self.metrics.sequences.labels(advance.reason).inc()

    def _fail_all(self, failure: Failed, waiting_too: bool = True) -> None:
        """Answers every running (and, unless told otherwise, waiting) sequence's request with failure."""
        sequences = [row.owner for row in self.batch.rows] + (list(self._waiting) if waiting_too else [])
        self.batch.reset()
        if waiting_too:
            self._waiting.clear()
        for request in {s.request for s in sequences}:
            request.post(failure)
        self.metrics.sequences.labels("error").inc(len(sequences))
        self._count()

    def _count(self) -> None:
        self.metrics.active.set(len(self.batch.rows))
        self.metrics.queue_depth.set(len(self._waiting))
