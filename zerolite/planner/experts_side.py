"""Where a mixture's routed experts compute on a GPU machine, layer by layer: copied over the link to
the GPU (their bytes over the link's rate), or computed by the CPU where their bytes are (their bytes
over its expert rate, their FLOPs over its FLOP/s, and the hidden states' round trip).

    predictions = experts_sides(costs, hardware, candidate, job, Pins(experts="auto"))

The link copies one layer's experts while the CPU computes another's, so a step takes the longer of
the two sides (with the rest of the copies and the compute on theirs), and moving a layer from one
side to the other shortens one and lengthens the other by a fixed amount: the best count of layers
on the CPU is where the two lines cross. auto prices none, all, and the whole numbers either side
of the crossing; the search keeps the quickest. device pins none, cpu all (or --cpu-expert-layers).
On a machine without a GPU the experts compute where they live, on the CPU: there is nothing to choose.
"""

from __future__ import annotations

import dataclasses
import math

from zerolite.planner.cost import Candidate, Job, Prediction, Rates, predict
from zerolite.planner.hardware import Hardware
from zerolite.planner.model_costs import ModelCosts

EXPERTS_PINS = ("auto", "device", "routed", "cpu")  # plan's: routed is device's other name, as generate takes it


def experts_sides(costs: ModelCosts, hardware: Hardware, c: Candidate, job: Job, experts: str | None,
                  cpu_expert_layers: int | None = None, rates: Rates | None = None) -> list[Prediction]:
    """c priced with each count of layers on the CPU worth trying (experts: the pin, None for auto;
    rates: the search's, zerolite.planner.cost.Rates)."""
    streamed = costs.layers - c.gpu_layers
    if not (hardware.gpu and costs.experts and streamed):
        return [predict(costs, hardware, c, job, rates)]

    def on_cpu(count: int) -> Prediction:
        return predict(costs, hardware, dataclasses.replace(c, cpu_expert_layers=count), job, rates)

    if experts in ("device", "routed", "whole"):  # whole: every expert to the device (priced as routed)
        return [on_cpu(0)]
    if experts == "cpu":
        return [on_cpu(streamed if cpu_expert_layers is None else min(cpu_expert_layers, streamed))]
    none, every = on_cpu(0), on_cpu(streamed)
    # The link's side less the compute's, as a line in the count of layers on the CPU: zero where they cross.
    lead, last = none.copy_s - none.compute_s, every.copy_s - every.compute_s
    if lead <= 0 or last >= 0:
        return [none, every]  # one side is the longer whatever the split
    crossing = streamed * lead / (lead - last)
    return [none, every] + [on_cpu(count) for count in {math.floor(crossing), math.ceil(crossing)} - {0, streamed}]

