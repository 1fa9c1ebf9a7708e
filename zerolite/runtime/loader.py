"""How a layout becomes a model that runs: the layout opened on each rank's device, then budgets,
one plan, the preflight, the parts (zerolite.runtime.parts) and the executor.

    layout, device = open_layout(folder, dtype), rank_device(policy, world)
    executor = build_executor(layout, policy, device, world, show_progress, timeline)

Every rank of a torchrun job calls these alike. Ranks agree through zerolite.distributed.world's gathers,
which pair up by their order alone: the gathers here must come in the same order on every rank,
and reordering them hangs the job.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from zerolite.distributed.world import World
from zerolite.errors import ZeroliteError
from zerolite.io.device import Device, cuda_available, cuda_device_count, resolve
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES, choose_dtype
from zerolite.progress import byte_progress
from zerolite.quant.linear import dense_bytes, keeps_dense
from zerolite.runtime.budget import Budgets
from zerolite.runtime.executor import Executor
from zerolite.runtime.parts import build_parts
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy
from zerolite.runtime.preflight import preflight
from zerolite.runtime.timeline import Timeline


def open_layout(folder, dtype: str | None) -> Layout:
    """The layout in folder, refused if it holds other weights than the dtype asked for."""
    layout = Layout.open(folder)
    if dtype is not None and DTYPES[layout.manifest.dtype] != choose_dtype(dtype, None):
        raise ZeroliteError(f"layout {folder} holds {layout.manifest.dtype} weights, not {dtype}: "
                            f"convert into another `path` with `dtype` {dtype}")
    return layout


def rank_device(policy: Policy, world: World) -> Device:
    """The policy's device, each rank on its own GPU under torchrun: cuda is LOCAL_RANK's, or the
    one GPU a rank sees where the launcher gives each rank its own (SLURM, Kubernetes)."""
    spec = policy.device
    if not isinstance(spec, str) or spec == "cpu" or world.local_size == 1:
        return policy.target()
    if spec.startswith("cuda:"):
        raise ZeroliteError(f"`device` {spec} would put the {world.local_size} ranks of a node on one GPU: "
                            "give `device` cuda, and each rank takes the GPU of its LOCAL_RANK")
    if spec == "auto" and not cuda_available():
        return policy.target()
    count = cuda_device_count()
    if count == 1:
        return resolve("cuda:0")
    if world.local_rank >= count:
        raise ZeroliteError(f"{world.local_size} ranks on this node but {count} GPU{'s' if count != 1 else ''}: give "
                            f"torchrun --nproc-per-node {count} or less")
    return resolve(f"cuda:{world.local_rank}")


def build_executor(layout: Layout, policy: Policy, device: Device, world: World, show_progress: bool,
                   timeline: Timeline, held_first: Callable[[], Policy] | None = None) -> Executor:
    """The executor for layout on device, alike on every rank:

    1. the ranks learn which of them share a GPU (shared_gpu); held_first (a draft, held whole)
       loads, and gives the policy to plan with; then each rank measures what its device and
       host memory hold (Budgets), its share where it shares its GPU
    2. one plan for every rank, from the smallest budgets: a node's host copy holds the same
       layers for all of its ranks
    3. each rank checks that the plan fits (preflight); the lead prints the warnings
    4. the parts (resident blocks read and bound, the host tier filled), and the executor's hooks
    """
    ranks_on_gpu = shared_gpu(device, world)

    def budget() -> Budgets:
        nonlocal policy
        if held_first is not None:  # first, so that the default budgets see what it left
            policy = held_first()
        return Budgets.make(layout.manifest, policy, device, world.local_size, ranks_on_gpu)

    measured = world.all_gather(budget, "loading")
    budgets = Budgets(min(b.device for b in measured), min(b.host for b in measured))
    plan = Plan.make(layout.manifest, policy, budgets, device.pinned_cost, world.local_size,
                     resident_dense(layout, device, policy), device.separate_memory)
    warnings = world.run_on_all(lambda: preflight(layout, plan, policy, device, world.local_size, ranks_on_gpu),
                                "checking memory")
    for warning in warnings if world.leads else ():
        print(f"zerolite: warning: {warning}", file=sys.stderr)

    built = []  # this rank's, to close if another rank failed

    def execute() -> None:
        loaded = [layout.manifest.block(name) for name in plan.loaded]
        with byte_progress("loading", sum(b.length for b in loaded), len(loaded), enabled=show_progress) as progress:
            built.append(Executor(build_parts(layout, policy, plan, device, world, progress, timeline)))

    try:
        world.run_on_all(execute, "loading")
    except BaseException:
        for executor in built:
            executor.close()
        raise
    executor = built[0]
    if executor.parts.experts_note and world.leads:
        print(f"zerolite: {executor.parts.experts_note}", file=sys.stderr)
    return executor


def shared_gpu(device: Device, world: World) -> int:
    """How many of the job's ranks run on this rank's GPU, told by its UUID (one gather): a launcher
    that gives every rank CUDA_VISIBLE_DEVICES of the same one GPU, or more ranks than GPUs, makes
    each see a whole GPU free, and each would plan to fill it."""
    if not world.distributed:
        return 1
    identities = world.all_gather(device.identity, "finding the GPUs")
    mine = identities[world.rank]
    return identities.count(mine) if mine is not None else 1


def resident_dense(layout: Layout, device: Device, policy: Policy):
    """What a block resident on this device takes beyond its stored bytes: a GPU keeps quantized
    weights dequantised (zerolite.quant.linear.keeps_dense); a CPU computes from them as stored."""
    if not keeps_dense(device, policy.offload):
        return lambda name: 0
    return functools.partial(dense_bytes, layout.manifest)
