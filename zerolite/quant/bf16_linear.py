"""A CPU's bf16 Linear layers, at a decode step's few rows, through zerolite's bf16 kernel
(zerolite.quant.cpu_kernels.bf16_matmul): a GEMV that reads each weight once at the memory's
speed, where torch's bf16 path read 6 to 23 GB/s by shape (the head's 131 MB at 6 to 10 GB/s:
docs/benchmarks-cpu-kernels.md). From KERNEL_ROWS rows on, torch's matmul (oneDNN: AMX) wins and runs.
Where the CPU has no bf16 instructions torch's bf16 matmul widens as it goes, slower than the kernel
at every row count (cpu_kernels.bf16_matmul_in_hardware): there the kernel runs up to KERNEL_ROWS, and
from there on (a prefill) torch's fp32 matmul of the rows and weight widened (fp32 sums either way).

    use_bf16_kernel(model)   # once, on the model a CPU runs; the weights bound later are read as bound

The modules stay what they were (their class becomes a subclass of nn.Linear that only changes
forward), so bindings, tied weights and state dicts see the same parameters under the same names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolite.quant.cpu_kernels import Bf16Matmul, bf16_matmul_in_hardware

# Below this many rows the kernel beats torch's bf16 matmul (docs/benchmarks-cpu-kernels.md): from 4 on, level
# with AMX or AVX-512 BF16. Without them (an AVX2 EPYC, 2 threads, 2048 x 5632): 512 rows take torch's bf16
# 575 ms, the kernel 114-122, widening the weight (6 ms) for fp32's matmul 100-108; 256 rows level.
KERNEL_ROWS = 4 if bf16_matmul_in_hardware() else 256
# The dtype torch's matmul runs in from KERNEL_ROWS rows on.
TORCH_DTYPE = torch.bfloat16 if bf16_matmul_in_hardware() else torch.float32
_CPU = torch.device("cpu")


class Bf16KernelLinear(nn.Linear):
    """nn.Linear whose few-row bf16 calls on a CPU go through the kernel, made once for the weight
    (a decode step's calls then add a few microseconds to the kernel's: the head's, and every
    layer's of a bf16 model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        if x.dtype != torch.bfloat16 or x.device != _CPU:
            return F.linear(x, weight, self.bias)
        if x.numel() >= KERNEL_ROWS * self.in_features:
            if TORCH_DTYPE == torch.bfloat16:
                return F.linear(x, weight, self.bias)
            bias = self.bias
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()
        kernel = self.__dict__.get("kernel")  # the class was swapped in (use_bf16_kernel): no __init__ of its own
        if kernel is None or kernel.weight is not weight:
            if weight.dtype != torch.bfloat16 or not weight.is_contiguous() or weight.device != _CPU:
                return F.linear(x, weight, self.bias)
            kernel = self.kernel = Bf16Matmul(weight)
        y = kernel(x if x.is_contiguous() else x.contiguous())
        bias = self._parameters["bias"]
        return y if bias is None else y + bias


def use_bf16_kernel(model: nn.Module) -> None:
    """Every plain nn.Linear of model computes through Bf16KernelLinear (subclasses are left as they are)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Bf16KernelLinear
