"""The command line under torchrun: every rank checks it was given rank 0's arguments."""

from __future__ import annotations

from zerolite.cli.options import flag
from zerolite.distributed.world import World
from zerolite.errors import ZeroliteError

# What rank 0 alone reads and writes under torchrun: the other ranks' values of these are not used.
RANK_ZEROS_OWN = ("input_file", "output", "stats_json")


def start_world(arguments: dict):
    """The ranks of this job (one without torchrun), once each has checked that every rank was
    given the arguments rank 0 was."""
    world = World.from_env()
    world.start()
    given = world.all_gather(lambda: arguments, "starting")
    world.run_on_all(lambda: same_arguments(given), "checking the arguments")
    return world


def refuse_ranks(ranks: int) -> None:
    if ranks > 1:
        raise ZeroliteError(f"zerolite serve runs as one process, and torchrun started {ranks}: start it without "
                            "torchrun (the server batches its clients into each pass over the weights itself)")


def same_arguments(given: list[dict]) -> None:
    for rank, arguments in enumerate(given):
        differ = [name for name in arguments if arguments[name] != given[0][name]]
        if differ:
            name = differ[0]
            raise ZeroliteError(f"rank {rank} was started with {flag(name)} {arguments[name]!r}, rank 0 with "
                                f"{given[0][name]!r}: give every node the same zerolite command")
