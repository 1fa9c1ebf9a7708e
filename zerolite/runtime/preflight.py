"""Checks before any weight is loaded, reported in one place: will this plan fit this machine?

Errors (the run could not succeed) raise a ZeroliteError naming what to change; warnings (it will
run, slower or riskier than it could) are returned for the caller to print, one line each.
"""

from __future__ import annotations

import psutil

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.io.engine import supports_direct_io
from zerolite.layout.folder import Layout
from zerolite.quant.linear import cpu_dequantize_workspace, dense_bytes, dequantize_workspace, keeps_dense
from zerolite.runtime.budget import device_slot_bytes
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy
from zerolite.runtime.resident import STAGING_BYTES


def preflight(layout: Layout, plan: Plan, policy: Policy, device: Device, ranks_here: int = 1,
              ranks_on_gpu: int = 1) -> list[str]:
    """ranks_here: the ranks on this node (torchrun), which share one copy of what host memory
    holds of the weights, each with its own ring and expert cache. ranks_on_gpu: the ranks that
    share this rank's GPU, each with its share of the free memory."""
    manifest = layout.manifest
    separate = device.separate_memory
    resident = manifest.nbytes(plan.resident)
    slot = max((manifest.block(name).length for name in plan.streamed), default=0)
    host_slots = policy.prefetch_depth * device.pinned_cost(slot) if plan.on_disk else 0
    warnings = []

    available = psutil.virtual_memory().available
    if separate:
        # Host memory holds pinned bytes (the staging resident blocks pass through while loading,
        # then the memory tier and the ring's read buffers) and the expert cache. Pinned memory
        # cannot be swapped out, so it is checked against what is physically available, at what
        # pinning really takes (RLIMIT_MEMLOCK does not bound CUDA's host registration, so it says nothing here).
        shared = sum(device.pinned_cost(manifest.block(name).length) for name in plan.in_host(separate))
        each = host_slots + plan.expert_cache
        staging = 2 * device.pinned_cost(STAGING_BYTES) if plan.resident else 0
        host_needed = max(ranks_here * staging, shared + ranks_here * each)
        what = "pins"
    else:
        shared = manifest.nbytes(plan.in_host(separate))
        each = host_slots + plan.expert_cache + cpu_dequantize_workspace(manifest)  # and a prefill's scratch
        host_needed = shared + ranks_here * each
        what = "holds"
    if ranks_here > 1:
        what += (f" (for the {ranks_here} ranks on this node: one copy of {shared / 1e9:.1f} GB, "
                 f"and {each / 1e9:.1f} GB each)")
    if host_needed > available:
        if policy.offload == "none":
            fix = "use `offload` nvme to stream the layers from disk"
        elif policy.offload == "cpu":
            fix = "use `offload` nvme to stream the layers that do not fit from disk"
        elif policy.cpu_memory is not None and plan.in_memory:
            fix = "lower `cpu_memory`"
        else:
            fix = "lower `prefetch_depth`"
        raise ZeroliteError(
            f"this plan {what} {host_needed / 1e9:.1f} GB in host memory but {available / 1e9:.1f} GB is available: "
            f"{fix}"
        )

    if separate:
        free = device.memory()[0] // ranks_on_gpu
        # Resident quantized weights kept dequantised, and a streamed one dequantised per call.
        kept = keeps_dense(device, policy.offload)
        dense = sum(dense_bytes(manifest, name) for name in plan.resident) if kept else 0
        ring = policy.prefetch_depth * device_slot_bytes(manifest, plan.streamed, policy)
        device_needed = resident + dense + ring + dequantize_workspace(manifest)
        if device_needed > free:
            raise ZeroliteError(
                f"this plan puts {device_needed / 1e9:.1f} GB on {device.name} but {free / 1e9:.1f} GB is free: "
                + ("lower `gpu_memory`" if policy.gpu_memory is not None else "lower `prefetch_depth`, or free the GPU")
            )

    if plan.on_disk and not all(map(supports_direct_io, layout.read_paths)):
        warnings.append(
            f"{layout.folder} is on a file system without O_DIRECT (older tmpfs, some network file systems): "
            "reading through the page cache, which costs host memory and bandwidth"
        )
    return warnings
