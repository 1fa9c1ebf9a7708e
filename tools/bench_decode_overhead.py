"""Where a CPU decode step spends its process CPU time, weights in RAM (offload="cpu"), at batch 1 or
more: zerolite's matmul kernels, zerolite's Linear wrappers around them (checks, output buffers, the
kernels' Python entry points; torch's own matmul where a wrapper hands the rows to it, as the bf16
head does from 4 rows), the executor's per-layer hooks, and transformers' pieces of a layer: norms,
rotary, the K/V cache's update, attention; the rest is the other modules and torch ops (the MLP's
activation and products, residual adds, embedding, sampling) and Python.

    .venv/bin/python tools/bench_decode_overhead.py LAYOUT [LAYOUT ...] [--batch 16] [--rounds 3] [--new-tokens 9]
                                                   [--threads N]

--threads 1 keeps the kernels on the calling thread, so that the process CPU is the step's work
and none of it a pool worker's wait.

A step's figures are generate(new_tokens) less generate(1), over new_tokens - 1: the prefill
cancels. Each span is timed by wrapping its function (a microsecond or two of its own per call,
counted in that span) and holds only its own time: a span inside another (a kernel inside its
wrapper) is taken out of the outer one. Process CPU counts every thread: a span also holds what the
kernels' pool workers and torch's threads burn meanwhile (each pool worker watches up to 1 ms after
a kernel, yielding, before it sleeps: csrc/work_pool.cpp). The layouts alternate round by round, so
a machine loaded by others weighs on each alike.
"""

from __future__ import annotations  # noqa: I001 (zerolite before torch)

import zerolite  # before torch: zerolite sets torch's OpenMP wait policy (zerolite.openmp)

import argparse
import functools
import time

import torch
from transformers import cache_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import zerolite.quant.cpu_kernels as cpu_kernels
from zerolite.quant.bf16_linear import Bf16KernelLinear
from zerolite.quant.linear import QuantizedLinear
from zerolite.runtime.executor import Executor

SPANS = ("kernels", "wrappers", "hooks", "norms", "rotary", "cache", "attention")


class Spans:
    """Process CPU seconds per span, each span's own: time spent in a span entered inside it is the inner one's."""

    def __init__(self):
        self.spent = dict.fromkeys(SPANS, 0.0)
        self._inner = [0.0]  # per open span, the time of the spans inside it so far

    def reset(self) -> None:
        self.spent = dict.fromkeys(SPANS, 0.0)

    def enter(self) -> float:
        self._inner.append(0.0)
        return time.process_time()

    def leave(self, span: str, started: float) -> None:
        elapsed = time.process_time() - started
        self.spent[span] += elapsed - self._inner.pop()
        self._inner[-1] += elapsed

    def timed(self, span: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = self.enter()
            try:
                return function(*args, **kwargs)
            finally:
                self.leave(span, started)

        return timed


spans = Spans()


class TimedEngine:
    """The extension, its matmuls timed as "kernels"."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        function = getattr(self.engine, name)
        return spans.timed("kernels", function) if name.endswith("_matmul") else function


def time_hooks() -> None:
    """Executor.running's entry and exit (a layer's bind, unbind and slot bookkeeping) timed as "hooks"."""
    running = Executor.running

    class Timed:
        def __init__(self, executor, name: str):
            self.context = running(executor, name)

        def __enter__(self):
            spans.timed("hooks", self.context.__enter__)()

        def __exit__(self, *exc):
            return spans.timed("hooks", self.context.__exit__)(*exc)

    Executor.running = lambda executor, name: Timed(executor, name)


def time_modules(model: torch.nn.Module) -> None:
    """Norm and rotary modules (by their class names, as transformers names them) and every module
    of the models' own attention code: the rotary functions it calls and the attention function it looks up."""
    classes = {type(module) for module in model.modules()}
    for cls in classes:
        name = cls.__name__
        span = "norms" if name.endswith(("RMSNorm", "LayerNorm")) else "rotary" if "Rotary" in name else None
        if span and not getattr(cls.forward, "_timed", False):
            cls.forward = spans.timed(span, cls.forward)
            cls.forward._timed = True
        module = __import__(cls.__module__, fromlist=["_"])
        rotary = getattr(module, "apply_rotary_pos_emb", None)
        if rotary is not None and not getattr(rotary, "_timed", False):
            module.apply_rotary_pos_emb = spans.timed("rotary", rotary)
            module.apply_rotary_pos_emb._timed = True


def time_library() -> None:
    """zerolite's matmuls and Linear wrappers, the executor's hooks, transformers' cache updates and attention."""
    cpu_kernels._engine = TimedEngine(cpu_kernels._engine)
    for cls in (QuantizedLinear, Bf16KernelLinear):
        cls.forward = spans.timed("wrappers", cls.forward)
    time_hooks()
    cache_utils.Cache.update = spans.timed("cache", cache_utils.Cache.update)
    for name in ("sdpa", "flash_attention_2"):
        if name in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS[name] = spans.timed("attention", ALL_ATTENTION_FUNCTIONS[name])


def generate(lm, input_ids: torch.Tensor, new_tokens: int) -> tuple[float, float, dict[str, float]]:
    """(wall s, process CPU s, the spans' CPU s) of one greedy generate."""
    spans.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    lm.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - wall, time.process_time() - cpu, dict(spans.spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layouts", nargs="+")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=9)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch's threads, which the kernels take too (default torch's)")
    args = parser.parse_args()
    if args.batch < 1 or args.new_tokens < 2:
        parser.error("--batch must be at least 1 and --new-tokens at least 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    time_library()
    models = {layout: zerolite.load(layout, offload="cpu", device="cpu", show_progress=False)
              for layout in args.layouts}
    for lm in models.values():
        time_modules(lm.model)
    input_ids = torch.randint(100, 1000, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    for lm in models.values():
        generate(lm, input_ids, 3)  # warm: first-call allocations, the kernels' pool
    steps = args.new_tokens - 1
    for round_ in range(args.rounds):
        for layout, lm in models.items():
            wall_1, cpu_1, spans_1 = generate(lm, input_ids, 1)
            wall_n, cpu_n, spans_n = generate(lm, input_ids, args.new_tokens)
            ms = {span: (spans_n[span] - spans_1[span]) / steps * 1e3 for span in SPANS}
            cpu = (cpu_n - cpu_1) / steps * 1e3
            parts = " + ".join(f"{span} {ms[span]:.1f}" for span in SPANS)
            wall = (wall_n - wall_1) / steps * 1e3
            print(f"round {round_} {layout} batch {args.batch}: per step wall {wall:.1f} ms, "
                  f"process CPU {cpu:.1f} ms = {parts} + rest {cpu - sum(ms.values()):.1f}", flush=True)


if __name__ == "__main__":
    main()
