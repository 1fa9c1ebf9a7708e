"""Where a CPU decode step spends its process CPU time, weights in RAM (offload="cpu"): zerolite's
matmul kernels (each kernel's share too: an int4 layout's int4_matmul against its bf16 head's
bf16_matmul), zerolite's Linear wrappers around them (checks, output buffers, the kernels' Python
entry points), the executor's per-layer hooks, and the rest (transformers' modules and torch's ops:
norms, rotary, attention, the cache's concatenations, sampling).

    .venv/bin/python tools/bench_decode_overhead.py LAYOUT [LAYOUT ...] [--rounds 3] [--new-tokens 9]
                                                   [--batch-size 1] [--threads N]

--threads 1 keeps the kernels on the calling thread, so that the process CPU is the step's work
and none of it a pool worker's wait.

A step's figures are generate(new_tokens) less generate(1), over new_tokens - 1: the prefill
cancels. Each span is timed by wrapping its function (a microsecond or two of its own per call,
counted in that span). Process CPU counts every thread: a span also holds what the kernels'
pool workers burn meanwhile (each spins up to 50 us after a kernel before it sleeps:
csrc/work_pool.cpp). The layouts alternate round by round, so a machine loaded by others weighs
on each alike.
"""

from __future__ import annotations  # noqa: I001 (zerolite before torch)

import zerolite  # before torch: zerolite sets torch's OpenMP wait policy (zerolite.openmp)

import argparse
import time
from contextlib import contextmanager

import torch

import zerolite.quant.cpu_kernels as cpu_kernels
from zerolite.quant.bf16_linear import Bf16KernelLinear
from zerolite.quant.linear import QuantizedLinear
from zerolite.runtime.executor import Executor

SPANS = ("kernels", "wrappers", "hooks")
spent = dict.fromkeys(SPANS, 0.0)
spent_by_kernel: dict[str, float] = {}  # the "kernels" span, by the kernel's name


class TimedEngine:
    """The extension, its matmuls timed as "kernels"."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        function = getattr(self.engine, name)
        if not name.endswith("_matmul"):
            return function

        def timed(*args):
            started = time.process_time()
            try:
                return function(*args)
            finally:
                seconds = time.process_time() - started
                spent["kernels"] += seconds
                spent_by_kernel[name] = spent_by_kernel.get(name, 0.0) + seconds

        return timed


def time_wrappers(cls) -> None:
    """cls.forward timed as "wrappers" (the kernels inside it are taken out when reported)."""
    forward = cls.forward

    def timed(self, x):
        started = time.process_time()
        try:
            return forward(self, x)
        finally:
            spent["wrappers"] += time.process_time() - started

    cls.forward = timed


def time_hooks() -> None:
    """Executor.running's entry and exit (a layer's bind, unbind and slot bookkeeping) timed as "hooks"."""
    running = Executor.running

    @contextmanager
    def timed(self, name: str):
        started = time.process_time()
        context = running(self, name)
        context.__enter__()
        spent["hooks"] += time.process_time() - started
        try:
            yield
        finally:
            started = time.process_time()
            context.__exit__(None, None, None)
            spent["hooks"] += time.process_time() - started

    Executor.running = timed


def generate(lm, input_ids: torch.Tensor, new_tokens: int) -> tuple[float, float, dict[str, float]]:
    """(wall s, process CPU s, the spans' and the kernels' CPU s) of one greedy generate."""
    for span in SPANS:
        spent[span] = 0.0
    spent_by_kernel.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    lm.generate(input_ids=input_ids, max_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - wall, time.process_time() - cpu, {**spent, **spent_by_kernel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layouts", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=9)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, help="torch's threads, which the kernels take too (default torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels._engine = TimedEngine(cpu_kernels._engine)
    time_wrappers(QuantizedLinear)
    time_wrappers(Bf16KernelLinear)
    time_hooks()
    models = {layout: zerolite.load(layout, offload="cpu", device="cpu", show_progress=False)
              for layout in args.layouts}
    input_ids = torch.randint(100, 1000, (args.batch_size, args.prompt_tokens),
                              generator=torch.Generator().manual_seed(0))
    for lm in models.values():
        generate(lm, input_ids, 3)  # warm: first-call allocations, the kernels' pool
    steps = args.new_tokens - 1
    for round_ in range(args.rounds):
        for layout, lm in models.items():
            wall_1, cpu_1, spans_1 = generate(lm, input_ids, 1)
            wall_n, cpu_n, spans_n = generate(lm, input_ids, args.new_tokens)
            ms = {span: (spans_n[span] - spans_1.get(span, 0.0)) / steps * 1e3 for span in spans_n}
            cpu = (cpu_n - cpu_1) / steps * 1e3
            rest = cpu - ms["wrappers"] - ms["hooks"]
            kernels = ", ".join(f"{name} {ms[name]:.1f}" for name in sorted(ms) if name not in SPANS)
            print(f"round {round_} {layout}: per step wall {(wall_n - wall_1) / steps * 1e3:.1f} ms, "
                  f"process CPU {cpu:.1f} ms = kernels {ms['kernels']:.1f} ({kernels})"
                  f" + wrappers {ms['wrappers'] - ms['kernels']:.1f} + executor hooks {ms['hooks']:.1f}"
                  f" + rest (transformers, torch) {rest:.1f}", flush=True)


if __name__ == "__main__":
    main()
