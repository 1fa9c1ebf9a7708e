"""A prompts file through a loaded model into a completions file: the generate job, from Python as
from the command line, on one process or every rank of a torchrun job.

    lm = zerolite.load("/nvme/llama-70b", offload="cpu")         # under torchrun: on every rank
    stats = zerolite.generate_file(lm, "prompts.jsonl", "out.jsonl", Sampling(max_new_tokens=64))

Rank 0 reads the prompts and owns the output (CompletionLog: durable lines, resumable, one
writer); the other ranks get the prompts and the ids already done from it, and their completions
reach the file through it, so the file needs to be on rank 0's node only.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from zerolite.distributed.world import World
from zerolite.generate.outputs import CompletionLog
from zerolite.generate.prompts import Prompt, read_prompts
from zerolite.generate.run import generate_all
from zerolite.generate.stats import RunStats
from zerolite.sampling import Sampling


def open_job(world: World, stack: ExitStack, read,
             output: Path | None) -> tuple[list[Prompt], set, CompletionLog | None]:
    """Rank 0's prompts (read()) and the ids its output already holds, on every rank; and on rank
    0 the output's log, open for appending until stack closes."""
    log = None

    def start() -> tuple[list[Prompt], set]:
        nonlocal log
        todo = read()
        log = stack.enter_context(CompletionLog.open(output)) if output is not None else None
        return todo, set(log.done) if log is not None else set()

    todo, done = world.from_rank0(start, "reading the prompts")
    return todo, done, log


def generate_file(lm, input: str | os.PathLike, output: str | os.PathLike, sampling: Sampling = Sampling(),
                  batch_size: int | None = 8, show_progress: bool = True,
                  batching: str | None = None) -> RunStats | None:
    """Completes every prompt of input (JSONL) that output (JSONL) does not have yet; None when it
    has them all. batch_size None: the largest batch the memory holds. batching: continuous,
    static, or None: continuous where it can run (generate_all). Under torchrun every rank calls
    it alike, and rank 0 gets the totals over every rank."""
    with ExitStack() as stack:
        todo, done, log = open_job(lm.world, stack, lambda: read_prompts(Path(input)), Path(output))
        if all(prompt.id in done for prompt in todo):
            return None
        return generate_all(lm, todo, sampling, batch_size, log.append if log is not None else lambda batch: None,
                            show_progress, done, batching=batching)
