"""Large tensors in host memory on huge pages, set before torch allocates one.

torch hands a large CPU tensor back to the operating system when it is freed (glibc maps every
allocation above 32 MB on its own), so the next one faults its pages in anew, 4 kB at a time: a
quantized layer's K/V decoded for attention at every step, a prefill's activations and scores at
every layer. On 2 MB pages the kernel takes 512 times fewer faults, and the TLB covers more of what
the matmuls read. torch asks for them itself (madvise MADV_HUGEPAGE on allocations of 2 MB or more)
where THP_MEM_ALLOC_ENABLE=1, which it reads once, at its first large allocation; zerolite sets it
on import unless the user chose. A machine whose huge pages are off ignores the advice.

Measured (one thread, a 302 MB bf16 tensor made, filled and freed in turn, Sapphire Rapids,
process CPU): 0.17-0.21 s each on 4 kB pages, 0.08 s on huge pages.
"""

from __future__ import annotations

from zerolite.torch_env import set_before_torch

HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> None:
    set_before_torch(HUGE_PAGES, "1")
