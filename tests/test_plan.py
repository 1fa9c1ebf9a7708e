"""zerolite plan: a policy chosen and predicted from a config alone, the flags generate takes pinning
exactly the policy generate then runs, the cost model's arithmetic, and one line for what cannot be."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, BloomConfig

import zerolite
from support.cli_runner import run
from zerolite.io.device import CpuDevice
from zerolite.layout.folder import Layout
from zerolite.planner import measurements
from zerolite.planner.cost import Candidate, Job, predict
from zerolite.planner.hardware import ATTENTION_RECORD, Hardware
from zerolite.planner.model_costs import ModelCosts
from zerolite.planner.model_source import ModelSource
from zerolite.planner.search import Pins, search

FIELDS = {"batch_size", "weights", "kv_offload", "decode_step_s", "prefill_s", "tokens_per_s", "bottleneck"}
ROWS = (1, 4, 16, 64, 256, 1024)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This machine's record in a cache of the test's own, with compute rates set (the probes take
    seconds): every weight multiplied at 1 ns, however many rows, and attention streaming K/V at 10 GB/s."""
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    for dtype in (torch.float32, torch.bfloat16):
        key = measurements.compute_key(CpuDevice(), dtype)
        measurements.record(key, {w: {str(r): 1e-9 for r in ROWS} for w in ("stored", "int8", "int4")}, "compute")
        measurements.record(key, 10.0, ATTENTION_RECORD)
    return tmp_path


def plan_json(capsys, monkeypatch, *args) -> dict:
    result = run(capsys, monkeypatch, "plan", "--device", "cpu", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_from_a_config_alone_prints_the_fields_and_pins_what_it_is_given(machine, capsys, monkeypatch,
                                                                              make_source):
    config_only = machine / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((make_source("llama", layers=4) / "config.json").read_text())
    chosen = plan_json(capsys, monkeypatch, "--model", config_only, "--disk-gbps", "2GB/s")
    assert FIELDS <= chosen.keys() and chosen["hardware"]["sources"]["disk_gbps"] == "given"
    pinned = plan_json(capsys, monkeypatch, "--model", config_only, "--disk-gbps", "2GB/s", "--batch-size", "3",
                       "--weights", "int8", "--cpu-memory", "0", "--prefetch-depth", "3")
    assert (pinned["batch_size"], pinned["weights"], pinned["host_layers"], pinned["disk_layers"],
            pinned["prefetch_depth"]) == \
        (3, "int8", 0, 4, 3)
    assert pinned["command"][pinned["command"].index("--batch-size"):] == \
        ["--batch-size", "3", "--cpu-memory", "0", "--prefetch-depth", "3"] and "--weights" in pinned["command"]
    assert chosen["command"][-2] == "--prefetch-depth"  # every choice given: generate plans nothing anew


def test_a_pinned_host_budget_keeps_the_layers_generate_keeps(machine, capsys, monkeypatch, make_layout):
    layout = make_layout("llama", layers=6)
    for budget in ("0", "1MB", "3MB", "100MB"):
        planned = plan_json(capsys, monkeypatch, "--model", layout, "--disk-gbps", "2GB/s", "--cpu-memory", budget,
                            "--batch-size", "1")
        with zerolite.load(layout, device="cpu", cpu_memory=budget, show_progress=False) as lm:
            assert planned["host_layers"] == len(lm.plan.in_memory), budget
            assert planned["disk_layers"] == len(lm.plan.on_disk), budget


def test_a_path_not_made_yet_has_its_disk_measured_where_it_will_be(machine, capsys, monkeypatch, make_source):
    """With no disk rate recorded (a fresh machine), generate --path /nvme/new plans by measuring the
    disk at the nearest folder that exists, not refusing a folder the layout has yet to make."""
    import zerolite.planner.for_job

    measured = []
    monkeypatch.setattr(zerolite.planner.for_job, "measure_disk",
                        lambda target: measured.append(target) or {"read_gbps": 2.0, "bytes": 1 << 20})
    prompts = machine / "in.jsonl"
    prompts.write_text('{"id": 0, "input_ids": [5, 9, 12]}\n')
    done = run(capsys, monkeypatch, "generate", "--model", make_source("llama", layers=2), "--path",
               machine / "nvme" / "new", "--device", "cpu", "--input", prompts, "--max-new-tokens", "2")
    assert done.code == 0, done.stderr
    assert measured == [machine] and not done.stderr.startswith("plan: none"), done.stderr


def test_the_page_cache_is_dropped_only_for_a_disk_read_long_enough_to_be_recorded(monkeypatch, make_layout):
    import zerolite.planner.machine as machine_probe

    dropped = []
    monkeypatch.setattr(machine_probe, "drop_page_cache", lambda: dropped.append(True))
    layout = make_layout("llama", layers=2)
    machine_probe.measure_disk(layout)  # a tiny layout: its rate serves one plan, the machine's caches stay
    assert dropped == []
    monkeypatch.setattr(measurements, "DISK_RECORDED_BYTES", 1)
    machine_probe.measure_disk(layout)
    assert dropped == [True]


def test_profile_records_the_disk_rate_that_plan_then_uses(machine, capsys, monkeypatch, make_layout):
    monkeypatch.setattr(measurements, "DISK_RECORDED_BYTES", 0)  # a tiny layout's read pass stands for the disk here
    layout = make_layout("llama", layers=3)
    profiled = run(capsys, monkeypatch, "profile", "--model", layout, "--device", "cpu", "--cpu-memory", "0", "--json",
                   "--new-tokens", "3")
    assert profiled.code == 0, profiled.stderr
    read_gbps = json.loads(profiled.stdout)["read_gbps"]
    planned = plan_json(capsys, monkeypatch, "--model", layout)
    assert planned["hardware"]["disk_gbps"] == read_gbps
    assert planned["hardware"]["sources"]["disk_gbps"].startswith("recorded")


def hardware(**overrides) -> Hardware:
    figures = dict(gpu=False, gpu_ram=0, host_ram=64 << 30, disk_gbps=2.0, fill_gbps=0.5, h2d_gbps=None,
                   gpu_tflops=None, compute={w: {r: 1e-12 for r in ROWS} for w in ("stored", "int8", "int4")})
    return Hardware(**{**figures, **overrides})


def llama_costs(layers=8) -> ModelCosts:
    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                                  num_attention_heads=8, vocab_size=1000)
    return ModelCosts.from_config(config, torch.bfloat16, "llama")


def test_a_disk_bound_step_is_the_streamed_bytes_over_the_disks_rate():
    costs, machine = llama_costs(), hardware()
    p = predict(costs, machine, Candidate("stored", 4, host_layers=3), Job(16, 8))
    assert p.bottleneck == "disk"
    assert p.decode_step_s == pytest.approx(5 * costs.formats["stored"].layer_bytes / 2e9)
    int4 = predict(costs, machine, Candidate("int4", 4, host_layers=3), Job(16, 8))
    assert int4.decode_step_s == pytest.approx(5 * costs.formats["int4"].layer_bytes / 2e9)
    assert costs.formats["int4"].layer_bytes < 0.3 * costs.formats["stored"].layer_bytes


def test_filling_host_memory_pays_off_only_for_a_long_job():
    """The issue's 26 GB case: host memory filled at 0.32 GB/s, the disk streamed at 2.2 GB/s."""
    costs, machine = llama_costs(), hardware(fill_gbps=0.32, disk_gbps=2.2)
    short = search(costs, machine, Job(16, 4, prompts=1), Pins(weights="stored", batch_size=1)).best
    long = search(costs, machine, Job(16, 256, prompts=64), Pins(weights="stored", batch_size=1)).best
    assert short.candidate.host_layers == 0
    assert long.candidate.host_layers == costs.layers


def test_zero_inference_setting_is_predicted_within_30_percent_and_the_choice_reaches_the_goal(tmp_path, capsys,
                                                                                               monkeypatch):
    """DeepSpeed ZeRO-Inference's published setting: BLOOM-176B fp16 on an RTX A6000 (48 GB) with
    252 GB of DRAM and a 5.6 GB/s NVMe, batch 32, 512 prompt and 32 new tokens, weights read from
    NVMe and the K/V cache in host memory: 0.47 tokens/s. A PCIe 4 x16 link (25 GB/s) and the
    A6000's 77 dense fp16 TFLOPS (fp32 accumulate) complete the machine."""
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    bloom = tmp_path / "bloom"
    BloomConfig(hidden_size=14336, n_layer=70, n_head=112, vocab_size=250880, dtype="float16").save_pretrained(bloom)
    machine = ["--model", bloom, "--gpu-ram", "48GB", "--host-ram", "252GB", "--disk-gbps", "5.6GB/s", "--h2d-gbps",
               "25GB/s", "--gpu-tflops", "77TFLOPS", "--prompt-tokens", "512", "--new-tokens", "32"]
    published = plan_json(capsys, monkeypatch, *machine, "--batch-size", "32", "--weights", "stored", "--cpu-memory",
                          "0", "--gpu-memory", "0", "--kv-offload", "1")
    assert published["disk_layers"] == 70 and published["bottleneck"] == "disk"
    assert abs(published["tokens_per_s"] / 0.47 - 1) <= 0.30, published["tokens_per_s"]
    chosen = plan_json(capsys, monkeypatch, *machine)
    assert chosen["tokens_per_s"] >= 2.5, chosen


@pytest.mark.parametrize("flag, value", [("--disk-gbps", "5.6"), ("--h2d-gbps", "25"), ("--gpu-tflops", "77"),
                                         ("--disk-gbps", "fast")])
def test_hardware_flags_without_units_are_refused_in_one_line(capsys, monkeypatch, flag, value):
    result = run(capsys, monkeypatch, "plan", flag, value)
    assert result.code != 0 and len(result.stderr.strip().splitlines()) == 1
    assert flag in result.stderr and ("unit" in result.stderr or "not a rate" in result.stderr)


def test_a_model_that_cannot_fit_says_what_must_change(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    bloom = tmp_path / "bloom"
    BloomConfig(hidden_size=14336, n_layer=70, n_head=112, vocab_size=250880, dtype="float16").save_pretrained(bloom)
    result = run(capsys, monkeypatch, "plan", "--model", bloom, "--gpu-ram", "8GB", "--host-ram", "252GB",
                 "--disk-gbps", "5.6GB/s", "--h2d-gbps", "25GB/s", "--gpu-tflops", "77TFLOPS")
    assert result.code != 0 and len(result.stderr.strip().splitlines()) == 1
    assert "cannot run here" in result.stderr and "GPU with" in result.stderr, result.stderr


def test_generate_streams_every_layer_for_a_short_job_and_holds_them_for_a_long_one(machine, capsys, monkeypatch,
                                                                                    make_layout, tmp_path):
    """A disk that streams a layer in 1 s a step and host memory that fills at a sixth of that:
    holding the layers pays off only over many steps, and generate's default budget follows. (The
    disk slow beside any compute this machine measures for the tiny model: a layer streamed
    between held ones then costs a step its read, whatever the probe saw.)"""
    layout = make_layout("llama", layers=3)
    layer_bytes = Layout.open(layout).manifest.block("layers.0").length
    measurements.record(measurements.file_system(layout), layer_bytes / 1.0 / 1e9, "disk_gbps")
    measurements.record_fill(layer_bytes, 6.0)
    for prompts, tokens, held in ((1, 2, 0), (16, 24, 3)):
        file = tmp_path / f"prompts-{prompts}.jsonl"
        file.write_text("".join(json.dumps({"id": i, "input_ids": [5, 9, 3, 7]}) + "\n" for i in range(prompts)))
        result = run(capsys, monkeypatch, "generate", "--model", layout, "--device", "cpu", "--input", file,
                     "--max-new-tokens", tokens, "--batch-size", "auto")
        assert result.code == 0, result.stderr
        assert f"{held} layers in host memory" in result.stderr, result.stderr
        assert ("layers streamed from disk" in result.stderr) == (held < 3), result.stderr


def test_the_fill_rate_is_every_loads_bytes_over_its_seconds(machine):
    """A small load warm in the caches below the guest must not speak for a large cold one."""
    measurements.record_fill(1_000_000_000, 0.3)
    measurements.record_fill(20_000_000_000, 22.0)
    assert measurements.fill_gbps() == pytest.approx(21 / 22.3)


# Each part of the planner, made to fail (where it is looked up when the plan runs): zerolite plan says
# one line naming it, generate runs on its defaults saying the same, neither shows an internal error.
# The layer probe alone has an estimate to fall back on (the matmul rates: test_compute_probe).
PLANNER_PARTS = {
    "read the model's sizes from its config": [("zerolite.planner.model_costs.ModelCosts.from_config", classmethod)],
    "measure the disk": [("zerolite.planner.machine.measure_disk", None),
                         ("zerolite.planner.for_job.measure_disk", None)],
    "time this machine's matmuls": [("zerolite.planner.hardware.probe_compute", None)],
    "weigh the plans": [("zerolite.planner.search.predict", None),  # the cost model
                        ("zerolite.planner.experts_side.predict", None)],
}


@pytest.mark.parametrize("part", PLANNER_PARTS)
def test_a_part_of_the_planner_that_fails_is_one_line_for_plan_and_none_for_generate(part, tmp_path, capsys,
                                                                                     monkeypatch, make_source):
    from support.cli_runner import assert_one_line_error

    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))  # nothing recorded: every part runs
    if part != "time this machine's matmuls":  # the real probe takes seconds
        measurements.record(measurements.compute_key(CpuDevice(), torch.float32),
                            {w: {str(r): 1e-9 for r in ROWS} for w in ("stored", "int8", "int4")}, "compute")

    def fails(*args, **kwargs):
        raise RuntimeError("injected\nand a second line")

    for target, wrap in PLANNER_PARTS[part]:
        monkeypatch.setattr(target, wrap(fails) if wrap else fails)
    source = make_source("llama")
    planned = run(capsys, monkeypatch, "plan", "--model", source, "--device", "cpu", "--json")
    assert_one_line_error(planned, f"the planner could not {part}", "RuntimeError: injected and a second line")
    if part == "measure the disk":  # profile --disk runs the same measure alone
        assert_one_line_error(run(capsys, monkeypatch, "profile", "--disk", source), "could not measure the disk")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 0, "input_ids": [5, 17, 33]}\n')
    generated = run(capsys, monkeypatch, "generate", "--model", source, "--device", "cpu", "--input", prompts,
                    "--output", tmp_path / "out.jsonl", "--max-new-tokens", "2")
    assert generated.code == 0 and "Traceback" not in generated.stderr, generated.stderr
    none = [line for line in generated.stderr.splitlines() if line.startswith("plan: none for this job")]
    assert len(none) == 1 and f"(the planner could not {part}" in none[0], generated.stderr


def test_generate_with_only_a_layout_as_path_plans_that_layout(make_layout):
    """`generate --path LAYOUT` with no --model runs that layout: its plan is of that model, not the
    built-in one (whose GGUF it would convert first)."""
    layout = make_layout("gpt2")
    source = ModelSource.resolve(None, None, layout)
    assert source.name == str(layout) and source.config.model_type == "gpt2"
    assert source.disk_target == Layout.open(layout).read_paths[0]
