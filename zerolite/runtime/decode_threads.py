"""A CPU forward of few rows (a decode step): torch's own ops on one thread, zerolite's kernels on
the threads torch had.

    threads = DecodeThreads(model, kernel_rows(manifest))   # where a few-row forward's matmuls are zerolite's
    threads.restore()                # after a forward that raised (its end hook never ran)
    threads.remove()

Outside the matmuls a decode step's tensors are a few rows of the hidden size, yet from 16 rows of
2048 on (torch's grain, 32768 elements) each elementwise op, norm and cache concatenation splits
across torch's OpenMP threads: hundreds of parallel regions a step, each waking a thread for a few
microseconds of work. Where torch was imported before zerolite, those threads also spin after each
region (zerolite.openmp) and take the cores the kernels' own pool needs: a batch-16 int4 step on 2
cores then took 5x the process CPU time (870 ms against 173: tools/bench_decode_overhead.py).
With torch on one thread there no region starts, and the step took 150 to 170 ms. A forward of
FEW_ROWS tokens or more (a prefill) keeps torch's threads: its matmuls and attention are torch's.
A bf16 layout's layers run zerolite's bf16 kernel below bf16_linear.KERNEL_ROWS rows (every row
count where the CPU has no bf16 instructions): its decode steps alike.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.layout.manifest import Manifest
from zerolite.quant import bf16_linear
from zerolite.quant.cpu_kernels import set_kernel_threads

# Tokens in a forward below which it is a decode step: where the quantized layers run zerolite's
# kernels rather than dequantising for torch's matmul (zerolite.quant.linear's INT4_DEQUANTIZE_ROWS).
FEW_ROWS = 64


def kernel_rows(manifest: Manifest) -> int:
    """The tokens below which a CPU forward of this layout's model multiplies through zerolite's
    kernels alone (0: never, its matmuls are torch's, an fp32 layout's)."""
    if manifest.quantization is not None:
        return FEW_ROWS
    if manifest.dtype == "bfloat16":  # every Linear a Bf16KernelLinear (zerolite.runtime.parts)
        return min(FEW_ROWS, bf16_linear.KERNEL_ROWS)
    return 0


def tokens_in(args: tuple, kwargs: dict) -> int | None:
    """The tokens a model's forward was given (input_ids or inputs_embeds), None if neither."""
    for name, tail in (("input_ids", 0), ("inputs_embeds", 1)):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value.shape[:value.dim() - tail].numel()
    if args and isinstance(args[0], torch.Tensor):
        return args[0].numel()
    return None


class DecodeThreads:
    def __init__(self, model: nn.Module, few_rows: int = FEW_ROWS):
        self._few_rows = few_rows
        self._torch_threads: int | None = None  # torch's count while a few-row forward runs on one
        self._hooks = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                       model.register_forward_hook(lambda *_: self.restore())]

    def _start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        rows = tokens_in(args, kwargs)
        threads = torch.get_num_threads()
        if rows is None or rows >= self._few_rows or threads == 1 or self._torch_threads is not None:
            return
        self._torch_threads = threads
        set_kernel_threads(threads)
        torch.set_num_threads(1)

    def restore(self) -> None:
        """torch's threads as they were before the forward, the kernels back on torch's count."""
        if self._torch_threads is None:
            return
        torch.set_num_threads(self._torch_threads)
        set_kernel_threads(None)
        self._torch_threads = None

    def remove(self) -> None:
        self.restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
