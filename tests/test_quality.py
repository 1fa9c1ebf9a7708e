"""tools/quality.py's perplexity against a direct computation with transformers, windows included,
and the tool end to end on a tiny layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import zerolite
from perplexity import perplexity, windows  # tools/ is on the path: pyproject's pythonpath
from quality import score_kv_bits
from support.cli_runner import run_tool
from support.tiny_models import VOCAB, save_ascii_tokenizer
from zerolite import memory_model

WINDOW = 16  # the tiny model's max_position_embeddings: the 50 ids below need several windows


def direct_perplexity(model, ids: torch.Tensor, window: int, stride: int) -> float:
    """Each token predicted on its own, from the context the windows give it: from the start of the
    first window [k * stride, k * stride + window) that holds it, scored by cross-entropy over the
    shifted logits of that context."""
    losses = []
    for target in range(1, len(ids)):
        begin = max(0, (target - window) // stride + 1) * stride
        logits = model(input_ids=ids[None, begin : target + 1]).logits[0, :-1]
        losses.append(F.cross_entropy(logits, ids[begin + 1 : target + 1], reduction="none")[-1])
    return math.exp(torch.stack(losses).mean().item())


@pytest.mark.parametrize("length, window, stride",
                         [(50, 16, 8), (50, 16, 15), (50, 16, 1), (10, 16, 8), (16, 16, 8), (17, 16, 8)])
def test_windows_score_every_token_but_the_first_once_with_context(length, window, stride):
    scored = []
    for number, (begin, end, first) in enumerate(windows(length, window, stride)):
        assert begin < first < end <= length and end - begin <= window
        if number:
            assert first - begin >= window - stride
        scored += range(first, end)
    assert scored == list(range(1, length))


def test_a_stride_as_long_as_the_window_is_refused():
    with pytest.raises(ValueError, match="stride"):
        list(windows(50, 16, 16))


@torch.no_grad()
@pytest.mark.parametrize("stride", [None, 5])
def test_equals_transformers_scoring_each_token_on_its_context(make_source, make_layout, stride):
    source = make_source(max_position_embeddings=WINDOW)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(0))
    expected = direct_perplexity(model, ids, WINDOW, stride or WINDOW // 2)

    assert perplexity(model, ids, stride).perplexity == pytest.approx(expected, rel=1e-5)
    with zerolite.load(make_layout(max_position_embeddings=WINDOW), offload="cpu", device="cpu",
                       show_progress=False) as lm:
        assert perplexity(lm.model, ids, stride).perplexity == pytest.approx(expected, rel=1e-5)


@torch.no_grad()
def test_one_window_is_cross_entropy_over_the_shifted_logits(make_source):
    model = AutoModelForCausalLM.from_pretrained(make_source(), dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids[None]).logits[0]
    expected = math.exp(F.cross_entropy(logits[:-1], ids[1:]).item())
    assert perplexity(model, ids).perplexity == pytest.approx(expected, rel=1e-5)


def test_the_tool_runs_end_to_end_and_agrees_with_transformers(capsys, monkeypatch, make_source, tmp_path):
    source = make_source(max_position_embeddings=64, fresh=True)
    save_ascii_tokenizer(source)
    figures = tmp_path / "quality.json"
    done = run_tool(capsys, monkeypatch, "quality", "--model", source, "--path", tmp_path / "layouts", "--tokens",
                    "150", "--weights", "int8,int4-g32,int4-g64", "--reference", "--json", figures)
    assert done.code == 0, done.stderr
    rows = {row["variant"]: row for row in json.loads(figures.read_text())["variants"]}
    assert list(rows) == ["base", "int8", "int4-g32", "int4-g64", "transformers (reference)"]
    assert rows["base"]["layer_bytes"] > 0 and rows["base"]["change_pct"] == 0
    assert rows["transformers (reference)"]["perplexity"] == pytest.approx(rows["base"]["perplexity"], rel=1e-5)
    # int4-g64: the tiny model's MLP is 160 wide, so its last group is partial
    for name in ("int8", "int4-g32", "int4-g64"):
        assert rows[name]["available"] and math.isfinite(rows[name]["perplexity"])


def test_every_k_v_tier_scores_what_the_device_s_does(make_layout, monkeypatch):
    """--kv-bits 4 with the K/V on disk, in host memory attended on the CPU, and both beside the
    device: the keys grouped over tokens alike in every tier (groups of 4 here, so that the 22
    tokens fill several and leave one filling), the same perplexity as on the device."""
    monkeypatch.setattr(memory_model, "KV_KEY_TOKENS", 4)
    layout = make_layout("llama", layers=4)
    ids = torch.randint(0, VOCAB, (22,), generator=torch.Generator().manual_seed(2))
    sixteen, device = (row["perplexity"] for row in score_kv_bits(layout, ids, [16, 4], chunk=4))
    assert device != sixteen
    for tiers in (dict(kv_disk=1.0), dict(kv_offload=0.5, kv_disk=0.25, kv_attention="cpu")):
        assert score_kv_bits(layout, ids, [4], chunk=4, tiers=tiers)[0]["perplexity"] == device, tiers
