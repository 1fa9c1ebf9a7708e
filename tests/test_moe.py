"""Mixtures of experts streamed whole, layer by layer, through transformers' own MoE modules (the
fused 3-D expert tensors): greedy tokens and logits equal transformers' on the same weights in RAM,
one prompt and a padded batch, from disk and from host memory, at every ring depth."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_executor import BATCH, NEW_TOKENS, SETUPS, SINGLE, check_equal, greedy
from tiny_models import MOE_SHAPES

LAYERS = 6


@pytest.fixture(scope="module", params=list(MOE_SHAPES))
def tiny(request, make_source, make_layout):
    arch = request.param
    source = make_source(arch, layers=LAYERS)
    references = {}

    def reference(device: str):
        if device not in references:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
            with torch.no_grad():  # aligned copies, as test_executor's reference takes them
                for param in model.parameters():
                    param.data = param.data.clone()
            references[device] = [greedy(model, rows, device) for rows in (SINGLE, BATCH)]
        return references[device]

    return make_layout(arch, layers=LAYERS), reference


def test_the_tiny_experts_are_routed_apart(tiny):
    """Generation varies: a wrong expert's weights would show in the tokens."""
    _, reference = tiny
    new = reference("cpu")[1].sequences[:, -NEW_TOKENS:]
    assert len(set(new.flatten().tolist())) >= 4, new


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("setup", ["nvme", "cpu"])
def test_moe_generation_streamed_whole_equals_transformers(tiny, setup, depth):
    check_equal(tiny, SETUPS[setup], depth, "cpu")
