"""The search run for one generate job, before anything loads: what --batch-size auto and the
default host budget become.

    choice = choose_for_job(spec, prompts=40, prompt_tokens=30, new_tokens=64, batch_size=None)
    choice.best.candidate.batch_size, choice.best.cpu_memory

The job's length decides the host tier: filling host memory takes time a short job does not win
back, so a short job may stream every layer where a long one holds what fits. Whatever the user
set is pinned, and so are the K/V's bits and tiers and the micro-batches (their defaults where not
set). Of the choice, generate takes the batch, the host budget, (--experts auto) where a mixture's
experts compute and (--kv-attention auto) where attention over the K/V off the GPU runs; the GPU's
budget keeps its default (what is free), which holds at least the layers the search put there.
"""

from __future__ import annotations

from zerolite.planner.cost import Job
from zerolite.planner.cpu_experts import with_cpu_experts
from zerolite.planner.faults import planner_part
from zerolite.planner.hardware import Hardware
from zerolite.planner.machine import measure_disk
from zerolite.planner.model_costs import ModelCosts
from zerolite.planner.model_source import ModelSource
from zerolite.planner.search import Choice, Pins, search
from zerolite.runtime.load_spec import LoadSpec


def choose_for_job(spec: LoadSpec, prompts: int, prompt_tokens: int, new_tokens: int, batch_size: int | None,
                   device: str) -> Choice:
    """spec: what generate was asked to load (model, path, dtype, weights, and the policy's
    cpu_memory, prefetch_depth, kv_offload, kv_bits, kv_disk, kv_attention, micro_batches, offload: what it
    sets is pinned); device: as --device takes it."""
    source = ModelSource.resolve(spec.model, spec.dtype, spec.path)
    costs, hardware = model_and_machine(source, device)
    pins = Pins(weights=spec.weights or source.weights or "stored", batch_size=batch_size,
                kv_offload=spec.kv_offload or 0.0, cpu_memory=spec.cpu_memory, prefetch_depth=spec.prefetch_depth,
                offload=spec.offload, experts=None if spec.experts in (None, "auto") else spec.experts,
                cpu_expert_layers=spec.cpu_expert_layers, kv_bits=spec.kv_bits or 16, kv_disk=spec.kv_disk or 0.0,
                kv_attention=None if spec.kv_attention in (None, "auto") else spec.kv_attention,
                micro_batches=spec.micro_batches or 1)
    with planner_part("weigh the plans"):
        return search(costs, hardware, Job(prompt_tokens, new_tokens, prompts), pins)


def model_and_machine(source: ModelSource, device: str, **here) -> tuple[ModelCosts, Hardware]:
    """The model's costs from its config, and this machine's figures for it (as recorded, else
    measured now: the disk through measure_disk unless here says otherwise, compute probed with the
    model's own layer, and for a mixture on a GPU the CPU's rates for its experts); here:
    Hardware.here's other keywords. Whatever fails is one line naming the part (zerolite.planner.faults)."""
    with planner_part("read the model's sizes from its config"):
        costs = ModelCosts.from_config(source.config, source.dtype, source.name)
    with planner_part("measure this machine"):
        hardware = Hardware.here(device, source.disk_target, source.dtype, **{"measure_disk": measure_disk, **here},
                                 model=(source.config, costs.formats["stored"].layer_bytes))
        hardware = with_cpu_experts(hardware, costs, source.dtype)
    return costs, hardware
