"""Checks before any weight is loaded, reported in one place: will this plan fit this machine?

Errors (the run could not succeed) raise a ZeroliteError naming what to change; warnings (it will
run, slower or riskier than it could) are returned for the caller to print, one line each.
"""

from __future__ import annotations

import errno
import os
import resource

import psutil
import torch

from zerolite.errors import ZeroliteError
from zerolite.layout import Layout
from zerolite.plan import Plan
from zerolite.policy import Policy


def preflight(layout: Layout, plan: Plan, policy: Policy) -> list[str]:
    manifest = layout.manifest
    device = policy.torch_device
    on_cuda = device.type == "cuda"
    resident = manifest.nbytes(plan.resident)
    in_memory = manifest.nbytes(plan.in_memory)
    slots = policy.prefetch_depth * max((manifest.block(name).length for name in plan.streamed), default=0)
    host_slots = slots if plan.on_disk else 0
    warnings = []

    host_needed = max(resident, in_memory + host_slots) if on_cuda else resident + in_memory + host_slots
    available = psutil.virtual_memory().available
    if host_needed > available:
        if policy.offload == "none":
            fix = "use --offload nvme to stream the layers from disk"
        elif policy.offload == "cpu":
            fix = "use --offload nvme to stream the layers that do not fit from disk"
        elif policy.cpu_memory is not None and in_memory:
            fix = "lower --cpu-memory"
        else:
            fix = "lower --prefetch-depth"
        raise ZeroliteError(
            f"this plan holds {host_needed / 1e9:.1f} GB in host memory but {available / 1e9:.1f} GB is available: {fix}"
        )

    if on_cuda:
        free, _ = torch.cuda.mem_get_info(device)
        device_needed = resident + slots
        if device_needed > free:
            raise ZeroliteError(
                f"this plan puts {device_needed / 1e9:.1f} GB on {device} but {free / 1e9:.1f} GB is free: "
                + ("lower --gpu-memory" if policy.gpu_memory is not None else "lower --prefetch-depth, or free the GPU")
            )
        pinned = in_memory + host_slots
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and pinned > soft:
            warnings.append(
                f"RLIMIT_MEMLOCK is {soft / 1e6:.0f} MB and this plan pins {pinned / 1e9:.1f} GB of host memory: "
                "if pinning fails, raise the limit (ulimit -l unlimited)"
            )

    if plan.on_disk and not supports_direct_io(layout.data_path):
        warnings.append(
            f"{layout.folder} is on a file system without O_DIRECT (older tmpfs, some network file systems): reading through the page cache, "
            "which costs host memory and bandwidth"
        )
    return warnings


def supports_direct_io(path: os.PathLike) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise ZeroliteError(f"cannot open {path}: {e.strerror}") from e
    os.close(fd)
    return True
