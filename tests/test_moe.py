"""Mixtures of experts streamed whole, layer by layer, through transformers' own MoE modules (the
fused 3-D expert tensors): greedy tokens and logits equal transformers' on the same weights in RAM,
one prompt and a padded batch, from disk and from host memory, at every ring depth."""

from __future__ import annotations

import pytest

from test_executor import NEW_TOKENS, SETUPS, check_equal, layout_and_reference
from tiny_models import MOE_SHAPES


@pytest.fixture(scope="module", params=list(MOE_SHAPES))
def tiny(request, make_source, make_layout):
    return layout_and_reference(request.param, make_source, make_layout)


def test_the_tiny_experts_are_routed_apart(tiny):
    """Generation varies: a wrong expert's weights would show in the tokens."""
    _, reference = tiny
    new = reference("cpu")[1].sequences[:, -NEW_TOKENS:]
    assert len(set(new.flatten().tolist())) >= 4, new


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("setup", ["nvme", "cpu"])
def test_moe_generation_streamed_whole_equals_transformers(tiny, setup, depth):
    check_equal(tiny, SETUPS[setup], depth, "cpu")
