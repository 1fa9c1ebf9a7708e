"""The ranks of one job under torchrun, and the one way they agree: every rank runs a step, then
every rank learns every rank's result, or which rank failed and why.

    world = World.from_env()             # torchrun's RANK, WORLD_SIZE, LOCAL_RANK, ... (one rank without them)
    world.start()                        # the process group (gloo: small messages, on any device)
    sizes = world.all_gather(lambda: measure(), "measuring")     # [rank 0's, rank 1's, ...] on every rank
    plan = world.run_on_all(lambda: make_plan(), "planning")     # this rank's, once every rank has one
    todo = world.from_rank0(lambda: read_prompts(), "reading")   # rank 0's, handed to every rank

A rank that raises inside all_gather still takes part in the gather, carrying its error, so no rank
waits forever on one that failed: every rank then raises RankFailed, naming the rank. A rank that
failed before reaching a nested all_gather sends its error with the next one it reaches; the others
meet it there (gathers pair up by order), so the failure is known everywhere at one gather and no
gather follows it. Only all_gather talks between ranks: a barrier or broadcast of its own would
break that pairing.

Data parallel moves completions and counts, a few KB per batch: gloo carries them on any device,
so the GPUs' links stay with the copies.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from zerolite.errors import ZeroliteError, describe

T = TypeVar("T")

# Long enough for the slowest step between two gathers: a node's first rank reading the host copy
# of a large model while its other ranks wait.
GATHER_TIMEOUT = datetime.timedelta(hours=2)
DEBUG = "--debug" in sys.argv  # the failing rank prints its own traceback: the line rank 0 prints has none


class RankFailed(ZeroliteError):
    """A step failed on some rank; every rank raises this after the same gather. Rank 0 prints
    the line, the others exit quietly: but only once it has printed (part_ways), since torchrun
    stops every rank as soon as one exits with an error."""

    def __init__(self, message: str, world: World):
        super().__init__(message)
        self.printer = world.leads
        self._world = world

    def part_ways(self) -> None:
        """One last gather, after rank 0 printed: every rank is alive, having raised at the same one."""
        import torch.distributed as dist

        dist.all_gather_object([None] * self._world.size, None)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0          # this rank's place on its node: its GPU, and whether it loads the node's host copy
    local_size: int = 1          # ranks on this node: they share its host memory and its disk
    node: int = 0                # the node's number (torchrun's GROUP_RANK)

    @classmethod
    def from_env(cls) -> World:
        """The world torchrun describes in the environment; one rank where it describes none."""
        if "WORLD_SIZE" not in os.environ:
            return cls()
        number = {}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            text = os.environ.get(key)
            try:
                number[key] = int(text)
            except (TypeError, ValueError):
                raise ZeroliteError(f"the environment says WORLD_SIZE but {key} is {text!r}: start zerolite with "
                                    "torchrun, which sets them all") from None
        world = cls(number["RANK"], number["WORLD_SIZE"], number["LOCAL_RANK"], number["LOCAL_WORLD_SIZE"],
                    number["GROUP_RANK"])
        if not 0 <= world.rank < world.size or not 0 <= world.local_rank < world.local_size:
            raise ZeroliteError(f"the environment's ranks do not add up (RANK {world.rank} of {world.size}, LOCAL_RANK "
                                f"{world.local_rank} of {world.local_size}): start zerolite with torchrun")
        return world

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leads(self) -> bool:
        """Rank 0 prints the plan, the progress and the summary, and writes the output."""
        return self.rank == 0

    def start(self) -> None:
        """Joins the job's process group (once per process), at the address torchrun gives."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            try:
                dist.init_process_group("gloo", rank=self.rank, world_size=self.size, timeout=GATHER_TIMEOUT)
            except (RuntimeError, ValueError) as e:
                raise ZeroliteError(f"rank {self.rank} could not reach the others ({describe(e)}): check "
                                    "--master-addr and --master-port, and that every node runs the same "
                                    "torchrun") from e
            # While the interpreter is whole: gloo's threads still hold the last gather's tensors,
            # and freeing them during finalization aborts the process (SIGABRT), now and then.
            atexit.register(leave_group)

    def all_gather(self, step: Callable[[], T], what: str) -> list[T]:
        """Runs step here, then returns every rank's result, in rank order, on every rank; or,
        where step raised on any rank, raises RankFailed there and everywhere else."""
        if not self.distributed:
            return [step()]
        try:
            result, failure = step(), None
        except RankFailed:
            raise
        except ZeroliteError as e:
            result, failure = None, str(e)
        except Exception as e:  # a bug on one rank must not leave the others waiting for it
            if DEBUG:
                traceback.print_exc()
            result, failure = None, f"internal error: {describe(e)} (rerun with --debug for the traceback)"
        import torch.distributed as dist

        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, (result, failure, f"node {self.node} ({socket.gethostname()})"))
        failures = [(rank, error, host) for rank, (_, error, host) in enumerate(gathered) if error is not None]
        if failures:
            raise RankFailed(failed_line(failures, self.size, what), self)
        return [value for value, _, _ in gathered]

    def run_on_all(self, step: Callable[[], T], what: str) -> T:
        """Runs step on every rank and returns this rank's result: only failures travel."""
        mine = []
        self.all_gather(lambda: mine.append(step()), what)
        return mine[0]

    def from_rank0(self, step: Callable[[], T], what: str) -> T:
        """step's result on rank 0, handed to every rank (the others run nothing)."""
        return self.all_gather(step if self.leads else lambda: None, what)[0]


def failed_line(failures: list[tuple[int, str, str]], size: int, what: str) -> str:
    """One line for every failure of a gather: the same error on every rank (bad arguments) is
    said once, as one process would say it; else the first rank that failed, with its node."""
    if len(failures) == size and len({error for _, error, _ in failures}) == 1:
        return failures[0][1]
    rank, error, host = failures[0]
    others = f" (and on rank{'s' if len(failures) > 2 else ''} {', '.join(str(r) for r, _, _ in failures[1:])})" \
        if len(failures) > 1 else ""
    return f"rank {rank} on {host}{others}, {what}: {error}"


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


SINGLE = World()
