"""Which modules of a decoder layer hold a mixture's experts, and whether a step can read only the
experts its router picks.

transformers 5 keeps a mixture's experts fused: one experts module per layer whose parameters are
[num_experts, ...] tensors. Where that module is transformers' routed-experts kind (its class
carries @use_experts_implementation), the sparse block calls it as
experts(hidden_states, top_k_index, top_k_weights): a forward pre-hook sees the step's routing
before any expert weight is touched, and every implementation (eager, batched_mm, grouped_mm)
reads only the rows of the experts in top_k_index. That is what per-expert streaming rests on.
Other expert modules (JetMoe's ParallelExperts, called with token counts per expert, say) are
streamed with their whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Experts:
    path: str          # from the layer: "mlp.experts"
    count: int
    routed: bool       # called with the routing, so a step can read only the experts it picks
    kind: str          # the module's class name, for the line that says a model streams whole


def find_experts(layer: nn.Module) -> Experts | None:
    """The layer's experts module: one with an integer num_experts whose every weight is stacked
    [num_experts, ...], some of them matrices per expert (a router's [num_experts, hidden] weight
    is not); None for a dense layer (and the dense layers of mixed models)."""
    for path, module in layer.named_modules():
        count = getattr(module, "num_experts", None)
        tensors = list(module.parameters(recurse=False))
        if not isinstance(count, int) or count < 2 or not tensors:
            continue
        if all(t.dim() >= 2 and t.shape[0] == count for t in tensors) and any(t.dim() >= 3 for t in tensors):
            return Experts(path, count, routed=is_routed(module), kind=type(module).__name__)
    return None


def is_routed(module: nn.Module) -> bool:
    """transformers' @use_experts_implementation sets these on the instance; its forward takes
    (hidden_states, top_k_index, top_k_weights)."""
    return all(hasattr(module, flag) for flag in ("is_transposed", "is_concatenated", "has_gate"))
