"""A CPU's bf16 Linear layers, at a decode step's few rows, through zerolite's bf16 kernel
(zerolite.quant.cpu_kernels.bf16_matmul): a GEMV that reads each weight once at the memory's
speed, where torch's bf16 path read 6 to 23 GB/s by shape (the head's 131 MB at 6 to 10 GB/s:
docs/benchmarks-cpu-kernels.md). From KERNEL_ROWS rows on, torch's matmul (oneDNN: AMX) wins and runs.

    use_bf16_kernel(model)   # once, on the model a CPU runs; the weights bound later are read as bound

The modules stay what they were (their class becomes a subclass of nn.Linear that only changes
forward), so bindings, tied weights and state dicts see the same parameters under the same names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolite.quant.cpu_kernels import bf16_matmul

# Below this many rows the kernel beats torch's bf16 matmul (docs/benchmarks-cpu-kernels.md): from 4 on, level.
KERNEL_ROWS = 4


class Bf16KernelLinear(nn.Linear):
    """nn.Linear whose few-row bf16 calls on a CPU go through the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
                or not weight.is_contiguous() or x.numel() >= KERNEL_ROWS * self.in_features):
            return F.linear(x, weight, self.bias)
        y = bf16_matmul(x.reshape(-1, self.in_features), weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def use_bf16_kernel(model: nn.Module) -> None:
    """Every plain nn.Linear of model computes through Bf16KernelLinear (subclasses are left as they are)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Bf16KernelLinear
