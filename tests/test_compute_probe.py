"""The planner's probe of one of the model's own layers: it times a layer of every kind of family the
executor runs (sliding windows past their window, state-space and hybrid stacks, linear attention,
RWKV, a family with a cache of its own), shrinks a config the way transformers sets a layer count,
and where it still cannot time a layer the plan goes on from the matmul rates, saying so in one line."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoConfig

from support.cli_runner import run
from zerolite.io.device import CpuDevice
from zerolite.planner import compute_probe, hardware, measurements
from zerolite.planner.compute_probe import LAYER_CONTEXT, LAYER_ROWS, LAYER_STEPS, probe_layer
from zerolite.planner.shrunk_config import PROBE_VOCAB, shrunk

ATTENTION = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
WINDOW = 2  # the probe's steps run past it: its cache holds LAYER_CONTEXT + LAYER_STEPS + 1 positions by the last
# One tiny config per kind of layer stack, each as transformers builds it.
FAMILIES = {
    "gemma2": dict(sliding_window=WINDOW),                      # sliding and full attention, alternating
    "gemma3_text": dict(sliding_window=WINDOW),
    "cohere2": dict(sliding_window=WINDOW),
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4),   # state space, layer_types read-only
    "mamba2": dict(state_size=8, expand=2, num_heads=4, head_dim=16, n_groups=1, conv_kernel=4, chunk_size=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                  mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, use_mamba_kernels=False),
    "bamba": dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                  mamba_chunk_size=16),
    "recurrent_gemma": dict(lru_width=32, attention_window_size=WINDOW, block_types=["recurrent", "attention"]),
    # three linear-attention layers, then one of full attention: its first two layers alone do not run
    "qwen3_next": dict(linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, block_size=8),   # a cache class of its own
    "rwkv": dict(attention_hidden_size=32, context_length=256),                  # a `state`, not a cache
    "llama": dict(),
}


def tiny(family: str, **overrides):
    return AutoConfig.for_model(family, **{**ATTENTION, **FAMILIES[family], **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_times_a_layer_of_every_kind_of_family(family):
    probed = probe_layer(tiny(family), torch.float32, CpuDevice())
    rows = list(probed["layer"])
    assert rows == list(LAYER_ROWS[:len(rows)]) and len(rows) >= 2 and list(probed["step"]) == rows
    assert all(seconds > 0 for seconds in probed["layer"].values())
    assert all(seconds >= 0 for seconds in probed["step"].values())


def test_a_sliding_window_is_decoded_past_its_end_without_rolling_a_cache_back():
    """A sliding layer's cache keeps only its window: one that a step ran past cannot be cropped
    back to the context before it, so the probe must never try (it once did, after every step)."""
    config = tiny("gemma2")
    assert config.sliding_window < LAYER_CONTEXT + LAYER_STEPS
    assert "sliding_attention" in shrunk(config, 2)[0].layer_types
    probed = probe_layer(config, torch.float32, CpuDevice())
    assert len(probed["layer"]) >= 2


def test_a_shrunk_config_keeps_a_layer_of_each_kind_and_what_share_each_stands_for():
    qwen = shrunk(tiny("qwen3_next", num_hidden_layers=8), 2)  # 3 linear : 1 full, twice over
    assert (qwen[0].layer_types, qwen[1]) == (["linear_attention", "full_attention"], [0.75, 0.25])
    gemma = shrunk(tiny("gemma3_text", num_hidden_layers=12, sliding_window_pattern=6), 2)  # 5 sliding : 1 full
    assert gemma[0].layer_types == ["sliding_attention", "full_attention"] and gemma[1] == pytest.approx([5 / 6, 1 / 6])
    gemma = shrunk(tiny("gemma2", num_hidden_layers=6), 3)  # fewer kinds than layers: the earliest others too
    assert gemma == (gemma[0], [0.25, 0.5, 0.25])
    assert gemma[0].layer_types == ["sliding_attention", "full_attention"] * 1 + ["sliding_attention"]
    bamba = shrunk(tiny("bamba", num_hidden_layers=8, attn_layer_indices=[5]), 2)  # layers named by index: renumbered
    assert bamba[0].attn_layer_indices == [1] and bamba[0].layers_block_type == ["linear_attention", "full_attention"]
    assert bamba[1] == [7 / 8, 1 / 8]
    jamba = shrunk(tiny("jamba"), 2)  # derived from attn_layer_period and _offset (read-only): the first layers
    assert (jamba[0].num_hidden_layers, jamba[0].layers_block_type, jamba[1]) == (2, ["mamba", "attention"], [0.5, 0.5])
    mamba = shrunk(tiny("mamba"), 1)[0]
    assert mamba.layer_types == ["linear_attention"] and mamba.vocab_size == PROBE_VOCAB
    phi = shrunk(tiny("llama", vocab_size=32064, pad_token_id=32000, eos_token_id=[2, 32007]), 2)[0]
    # ids past the tiny vocabulary: an embedding refuses them
    assert (phi.pad_token_id, phi.eos_token_id) == (None, None)
    composite = AutoConfig.for_model("gemma3", text_config={**ATTENTION, "num_hidden_layers": 6},
                                     vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                        intermediate_size=64))
    small = shrunk(composite, 2)[0]
    assert type(small) is type(composite) and small.text_config.num_hidden_layers == 2
    assert composite.text_config.num_hidden_layers == 6  # the model's own config is left as it was


def test_a_layer_s_time_weighs_each_kept_layer_by_its_share(monkeypatch):
    """Qwen3-Next's kept linear-attention layer stands for three of every four layers: slowed by a
    fifth of a second, it makes the layer's time 0.15 s longer (their plain mean would say 0.1)."""
    monkeypatch.setattr(compute_probe, "PROBE_SECONDS", 0.0)  # two row counts
    original = compute_probe.LayerClock.leave

    def slowed(clock, index):
        if index == 0:  # the linear-attention layer
            time.sleep(0.2)
        original(clock, index)

    monkeypatch.setattr(compute_probe.LayerClock, "leave", slowed)
    layer = probe_layer(tiny("qwen3_next", num_hidden_layers=4), torch.float32, CpuDevice())["layer"][1]
    assert 0.15 <= layer < 0.2  # the slowed layer's time alone, unweighted, would be 0.2 and more


def test_a_model_with_a_vision_tower_is_timed_on_its_text_layers():
    """Cut to two text layers, the decoder stack may hold fewer weights than the vision tower's."""
    config = AutoConfig.for_model("gemma3", text_config={**ATTENTION, "num_hidden_layers": 6},
                                  vision_config=dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=2,
                                                     intermediate_size=1024))
    probed = probe_layer(config, torch.float32, CpuDevice())
    assert len(probed["layer"]) >= 2 and all(seconds > 0 for seconds in probed["layer"].values())


def test_the_probe_stops_at_the_rows_its_time_allows(monkeypatch):
    """A row count that would take the probe past PROBE_SECONDS is not begun: the first two always run."""
    monkeypatch.setattr(compute_probe, "PROBE_SECONDS", 0.0)
    probed = probe_layer(tiny("llama"), torch.float32, CpuDevice())
    assert list(probed["layer"]) == list(LAYER_ROWS[:2])


FALLBACK = "plan: could not time one of this model's layers (no layer here); compute estimated from matmul rates"


@pytest.fixture
def failing_probe(tmp_path, monkeypatch):
    """A probe that raises, in a cache of the test's own where the matmul rates are recorded (their
    probe takes seconds), and a folder holding a tiny model's config alone."""
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    rates = {weights: {str(rows): 1e-9 for rows in (1, 1024)} for weights in ("stored", "int8", "int4")}
    measurements.record(measurements.compute_key(CpuDevice(), torch.float32), rates, "compute")

    def fails(*args):
        raise ValueError("no layer here\nand a second line the user need not read")

    monkeypatch.setattr(hardware, "probe_layer", fails)
    folder = tmp_path / "model"
    tiny("llama").save_pretrained(folder)
    return folder


def test_a_probe_that_fails_leaves_plan_to_the_matmul_rates_in_one_line(failing_probe, capsys, monkeypatch):
    result = run(capsys, monkeypatch, "plan", "--model", failing_probe, "--device", "cpu", "--dtype", "fp32",
                 "--disk-gbps", "2GB/s", "--json")
    assert result.code == 0, result.stderr
    assert result.stderr.strip().splitlines() == [FALLBACK]
    assert "layer" not in json.loads(result.stdout)["hardware"]["sources"]


def test_a_probe_that_fails_costs_generate_nothing(failing_probe, make_source, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 0, "input_ids": [5, 17, 33]}\n')
    monkeypatch.setattr(measurements, "DISK_RECORDED_BYTES", 0)  # the tiny model's file stands for its disk
    result = run(capsys, monkeypatch, "generate", "--model", make_source("llama"), "--device", "cpu", "--input",
                 prompts, "--output", tmp_path / "out.jsonl", "--max-new-tokens", "3")
    assert result.code == 0, result.stderr
    assert result.stderr.count(FALLBACK) == 1 and "plan for 1 prompts" in result.stderr
    assert len(json.loads((tmp_path / "out.jsonl").read_text())["token_ids"]) == 3


def test_any_fault_of_the_planner_leaves_generate_its_defaults(make_source, tmp_path, capsys, monkeypatch):
    """Not the probe alone: whatever the planner raises, generate runs on the default budgets."""
    from zerolite.planner import for_job

    def faulty(*args):
        raise KeyError("rope_theta")

    monkeypatch.setattr(for_job, "choose_for_job", faulty)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 0, "input_ids": [5, 17, 33]}\n')
    result = run(capsys, monkeypatch, "generate", "--model", make_source("llama"), "--device", "cpu", "--input",
                 prompts, "--output", tmp_path / "out.jsonl", "--max-new-tokens", "3")
    assert result.code == 0, result.stderr
    assert "plan: none for this job ('rope_theta'); the default budgets stand" in result.stderr.splitlines()


def test_each_measuring_step_says_what_it_measures_on_a_terminal(tmp_path, monkeypatch):
    """What plan and generate measure before their first line shows, named, while it runs."""
    import io

    from rich.console import Console

    from zerolite import progress
    from zerolite.planner.hardware import Hardware

    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    screen = io.StringIO()
    monkeypatch.setattr(progress, "stderr", Console(file=screen, force_terminal=True, width=120))
    monkeypatch.setattr(hardware, "probe_compute", lambda *args: {"stored": {1: 1e-9}})  # the real one takes seconds
    Hardware.here("cpu", tmp_path, torch.float32, measure_disk=lambda folder: {"read_gbps": 2.0, "bytes": 1 << 30},
                  model=(tiny("llama"), 1 << 20))
    shown = screen.getvalue()
    for what in (f"measuring disk: reading {tmp_path}", "measuring compute: matmul rates",
                 "measuring compute: one of this model's layers"):
        assert what in shown, shown


def test_past_the_largest_batch_probed_a_layer_s_extra_cost_grows_on_a_line_not_in_proportion():
    """A busy machine's probe may stop at 16 rows, where a layer reads its weights and its extra
    over the matmul rates is a cost per op, the same at 1 row: a batch of 64 pays it once, not 4x."""
    from zerolite.planner.cost import Candidate, Job, predict
    from zerolite.planner.model_costs import ModelCosts

    costs = ModelCosts.from_config(tiny("llama"), torch.float32)
    flat = {1: 0.01, 16: 0.01}  # seconds a layer took at 1 and 16 rows, its matmuls next to nothing
    machine = hardware.Hardware(False, 0, 1 << 40, 1000.0, 1000.0, None, None, {"stored": {1: 1e-15, 1024: 1e-15}},
                                flat, {1: 0.0, 16: 0.0})
    step = predict(costs, machine, Candidate("stored", 64, costs.layers), Job(8, 8)).compute_s
    assert step == pytest.approx(costs.layers * 0.01, rel=0.05)
    growing = {1: 0.01, 16: 0.025}  # a cost per row on top: 1 ms a row, on past 16
    machine = hardware.Hardware(False, 0, 1 << 40, 1000.0, 1000.0, None, None, {"stored": {1: 1e-15, 1024: 1e-15}},
                                growing, {1: 0.0, 16: 0.0})
    step = predict(costs, machine, Candidate("stored", 64, costs.layers), Job(8, 8)).compute_s
    assert step == pytest.approx(costs.layers * (0.025 + 48 * 0.001), rel=0.05)
