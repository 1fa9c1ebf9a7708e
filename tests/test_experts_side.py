"""Where a mixture's routed experts compute on a GPU machine, as zerolite plan prices and chooses it
(zerolite.planner.experts_side, cpu_experts): DeepSeek-V3 from its config alone on a 24 GB GPU and
a dual-socket host, against the arithmetic by hand; auto taking the CPU, the GPU or a split of the
layers by the two sides' rates; the flags' bad values; and generate taking the plan's choice."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig

from support.cli_runner import assert_one_line_error, run
from zerolite.planner.cost import Candidate, Prediction
from zerolite.planner.cpu_experts import ROUND_TRIP_S
from zerolite.planner.model_costs import ModelCosts
from zerolite.planner.search import Choice

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), its FP8 quantization_config left out: zerolite
# converts it to bf16, then --weights int4.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "torch_dtype": "bfloat16",
}
# A GPU on a PCIe 4 x16 link, two Xeon sockets' matmuls (their expert rate given per test), one PCIe 4 NVMe drive.
LINKS = ["--h2d-gbps", "25GB/s", "--gpu-tflops", "165TFLOPS", "--disk-gbps", "7GB/s", "--cpu-tflops", "5TFLOPS"]
# An RTX 4090's 24 GB beside 1 TB of RAM, 300 GB/s of it streamed by the CPUs' matmuls.
MACHINE = [*LINKS, "--gpu-ram", "24GB", "--host-ram", "1TB", "--cpu-gbps", "300GB/s"]


RECKONED: dict[str, ModelCosts] = {}


@pytest.fixture
def deepseek_v3(tmp_path, monkeypatch):
    """A folder with DeepSeek-V3's config alone, and its costs reckoned once for every plan of these
    tests (its meta model of 61 layers takes seconds)."""
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "deepseek-v3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    reckon = ModelCosts.from_config.__func__

    def once(cls, config, dtype=None, name=""):
        assert config.model_type == "deepseek_v3"
        if "deepseek_v3" not in RECKONED:
            RECKONED["deepseek_v3"] = reckon(cls, config, dtype, name)
        return RECKONED["deepseek_v3"]

    monkeypatch.setattr(ModelCosts, "from_config", classmethod(once))
    return folder


def plan(capsys, monkeypatch, *args) -> dict:
    result = run(capsys, monkeypatch, "plan", "--json", "--weights", "int4", "--latency", "--kv-offload", "0", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_deepseek_v3_on_a_24gb_gpu_and_a_dual_socket_host_is_the_arithmetic_by_hand(deepseek_v3, capsys,
                                                                                    monkeypatch):
    """At batch 1 a token's routed experts are 8 of 256 per layer, each gate, up and down of 7168 x
    2048 in bf16 (a layout keeps a mixture's fused experts at the checkpoint's precision, whatever
    --weights: only the linears are quantized): 88 MB an expert, 705 MB a layer. The planner prices
    every one of the 61 layers as its widest, a mixture's. On the CPU, at 300 GB/s: 2.35 ms a layer,
    plus the hidden states' round trip, 0.146 s a step; over a 25 GB/s link they and the guessed
    experts no token picks (0.45 a layer) would take 2.15 s. With 1 TB of RAM the int4 layers (23 GB
    each, the experts' 22.5 GB of it) do not all fit: those left read from disk bound the step."""
    expert = 3 * 7168 * 2048 * 2
    routed = 8 * expert
    on_the_cpu = 61 * (routed / 300e9 + 2 * 7168 * 2 / 25e9 + ROUND_TRIP_S)
    chosen = plan(capsys, monkeypatch, "--model", deepseek_v3, *MACHINE)
    assert chosen["experts"] == "cpu" and chosen["cpu_expert_layers"] == 61
    assert chosen["cpu_s"] == pytest.approx(on_the_cpu, rel=1e-3) and on_the_cpu == pytest.approx(0.146, abs=1e-3)
    # The link moves the dense parts alone (attention and the shared expert: 231 M weights in int4,
    # 4-bit codes and a bf16 scale and zero per 64; the router's fp32 weight), the disk the dense parts and
    # the routed and wrongly guessed experts of the layers it holds (the first of them, unguessed, its 8
    # after its router).
    dense = 231_145_472 * (0.5 + 4 / 64) + 256 * 7168 * 4
    assert chosen["copy_s"] == pytest.approx(61 * dense / 25e9, rel=0.01)
    disk = (chosen["disk_layers"] * (dense + 8.45 * expert) + 7.55 * expert) / 7e9
    assert chosen["disk_layers"] > 0 and chosen["bottleneck"] == "disk"
    assert chosen["decode_step_s"] == pytest.approx(disk, rel=0.01)
    assert chosen["command"][chosen["command"].index("--experts"):][:2] == ["--experts", "cpu"]
    # The GPU's two slots hold dense parts: the 23 GB layers copied whole to it would not fit.
    assert chosen["gpu_bytes"] < 6e9
    assert_one_line_error(run(capsys, monkeypatch, "plan", "--weights", "int4", "--latency", "--model", deepseek_v3,
                              *MACHINE, "--experts", "device"),
                          "no policy the given flags allow fits", "on the GPU (24.0 GB)")


@pytest.mark.parametrize("cpu_gbps, experts, layers", [("300GB/s", "cpu", 61), ("2GB/s", "split", 5),
                                                       ("0.2GB/s", "device", 0)])
def test_auto_computes_the_experts_on_the_side_that_bounds_the_step_least(deepseek_v3, capsys, monkeypatch, cpu_gbps,
                                                                         experts, layers):
    """Every layer in host memory (2 TB, --offload cpu), so that the link and the CPU alone bound a
    step, on an H100's 80 GB, whose slots hold whole layers too (--experts device). A layer's
    routed experts take 29.8 ms over the link (with the guessed ones) and its dense part 5.5 ms; on
    the CPU 2.35 ms at 300 GB/s, 352 ms at 2 GB/s, 3.5 s at 0.2 GB/s. At 300 GB/s every layer's go to
    the CPU (the dense parts' copies then bound the step); at 2 GB/s the sides cross at 5.6 layers on
    the CPU: 2.151 - 0.0298 k s of copies against 0.352 k s of the CPU's, 5 layers the quicker; at
    0.2 GB/s one layer on the CPU takes longer than all of them over the link."""
    machine = ["--model", deepseek_v3, *LINKS, "--gpu-ram", "80GB", "--host-ram", "2TB", "--offload", "cpu",
               "--cpu-gbps", cpu_gbps]
    chosen = plan(capsys, monkeypatch, *machine)
    assert chosen["disk_layers"] == 0
    assert (chosen["experts"], chosen["cpu_expert_layers"]) == (experts, layers)
    pinned = {side: plan(capsys, monkeypatch, *machine, "--experts", side) for side in ("device", "cpu")}
    assert pinned["device"]["cpu_expert_layers"] == 0 and pinned["cpu"]["cpu_expert_layers"] == 61
    assert pinned["device"]["bottleneck"] == "copy"
    assert pinned["device"]["decode_step_s"] == pytest.approx(61 * (0.1374e9 + 8.45 * 3 * 7168 * 2048 * 2) / 25e9,
                                                              rel=0.01)
    fastest = min(p["decode_step_s"] for p in pinned.values())
    assert chosen["decode_step_s"] <= fastest * (1 + 1e-9)
    if experts == "split":
        assert chosen["decode_step_s"] < 0.95 * fastest
        assert chosen["command"][-4:-2] == ["--cpu-expert-layers", "5"]


@pytest.mark.parametrize("flags, says", [
    (["--experts", "gpu"], "unknown --experts 'gpu': choose device, cpu or auto"),
    (["--cpu-gbps", "300"], "--cpu-gbps '300' has no unit"),
    (["--cpu-tflops", "fast"], "--cpu-tflops 'fast' is not a rate"),
    (["--cpu-gbps", "0GB/s"], "--cpu-gbps must be above zero"),
    (["--experts", "device", "--cpu-expert-layers", "3"], "--cpu-expert-layers counts the layers whose experts"),
])
def test_bad_experts_flags_are_one_clear_line(capsys, monkeypatch, flags, says):
    assert_one_line_error(run(capsys, monkeypatch, "plan", *flags), says)


def test_a_mixture_on_a_cpu_computes_its_experts_where_they_live(tmp_path, capsys, monkeypatch):
    """No GPU: nothing to choose, whatever --experts says, and the plan says so."""
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "mixtral"
    AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4, vocab_size=100).save_pretrained(folder)
    from zerolite.io.device import CpuDevice
    from zerolite.planner import measurements
    from zerolite.planner.hardware import config_digest

    key = measurements.compute_key(CpuDevice(), torch.float32)
    rates = {w: {str(r): 1e-9 for r in (1, 4, 16, 64, 256, 1024)} for w in ("stored", "int8", "int4")}
    measurements.record(key, rates, "compute")  # nothing probed: the probes take seconds
    layer = {str(r): 1e-5 for r in (1, 16, 64, 256)}
    measurements.record(f"{key} | {config_digest(AutoConfig.from_pretrained(folder))}", {"layer": layer, "step": layer},
                        "layers")
    for experts in ("auto", "cpu"):
        result = run(capsys, monkeypatch, "plan", "--model", folder, "--device", "cpu", "--disk-gbps", "2GB/s",
                     "--experts", experts, "--batch-size", "1", "--prefetch-depth", "2")
        assert result.code == 0, result.stderr
        said = " ".join(result.stdout.replace("│", " ").split())  # the table's cells, their lines joined
        assert "routed experts computed where they live: on the CPU, with no GPU" in said, said
        assert "--experts" not in result.stdout


def test_generate_takes_the_plans_experts_for_auto_and_keeps_a_pinned_choice(monkeypatch):
    """generate's job plan (plan_the_job) hands the loader the split the search chose: --experts cpu
    with the count of layers, the loader spreading them (tests/test_moe.py runs such a split)."""
    from zerolite.cli import generate_command
    from zerolite.planner import for_job
    from zerolite.runtime.load_spec import LoadSpec

    def chosen(experts: str, layers: int) -> Prediction:
        return Prediction(Candidate("stored", 1, 4, cpu_expert_layers=layers), 1.0, 0.5, 0.0, 0.5, 0.2, "copy", 0.0,
                          2.0, 10.0, 0, 0, 0, 0, cpu_s=0.2, experts=experts)

    class Prompt:
        input_ids = [5, 6, 7]

    for experts, layers, expected in (("split", 5, ("cpu", 5)), ("cpu", 8, ("cpu", None)),
                                      ("device", 0, ("device", None))):
        made = Choice(chosen(experts, layers))
        monkeypatch.setattr(for_job, "choose_for_job", lambda *args, made=made, **kwargs: made)
        _, spec, line = generate_command.plan_the_job(LoadSpec(model="m", device="cpu"), [Prompt()], 4, None)
        assert (spec.experts, spec.cpu_expert_layers) == expected
        assert ("experts on the CPU in 5 layers" if experts == "split" else "experts") in line
        _, pinned, _ = generate_command.plan_the_job(LoadSpec(model="m", device="cpu", experts="device"),
                                                     [Prompt()], 4, None)
        assert (pinned.experts, pinned.cpu_expert_layers) == ("device", None)


def test_the_cpus_expert_rates_are_its_matmul_probes_recorded_once(tmp_path, monkeypatch):
    """A GPU machine's CPU: the compute probe run on the CPU (nn.Linear and zerolite's int8/int4
    kernels), recorded under the CPU's key as a plan for the CPU alone records it; its stored format
    (the experts' in every layout) read as bytes per second at one row and FLOP/s at the most rows.
    Given rates stand; a dense model or a machine without a GPU needs none."""
    from zerolite.planner import cpu_experts
    from zerolite.planner.hardware import Hardware

    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    probed = []

    def probe(device, dtype):
        probed.append(device.name)
        return {w: {1: 2e-11, 1024: 1e-13} for w in ("stored", "int8", "int4")}

    monkeypatch.setattr(cpu_experts, "probe_compute", probe)
    gpu = Hardware(gpu=True, gpu_ram=24 << 30, host_ram=1 << 40, disk_gbps=7.0, fill_gbps=7.0, h2d_gbps=25.0,
                   gpu_tflops=165.0)
    mixture = ModelCosts.from_config(AutoConfig.for_model(
        "mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, vocab_size=100), torch.bfloat16)
    for _ in range(2):
        rated = cpu_experts.with_cpu_experts(gpu, mixture, torch.bfloat16)
        assert (rated.cpu_gbps, rated.cpu_tflops) == pytest.approx((2 / 2e-11 / 1e9, 2 * 1024 / 1e-13 / 1e12))
    assert probed == ["cpu"] and rated.sources["cpu"] == "this CPU's matmuls, recorded"
    given = dataclasses.replace(gpu, cpu_gbps=300.0, cpu_tflops=5.0)
    assert cpu_experts.with_cpu_experts(given, mixture, torch.bfloat16) == given
    assert cpu_experts.with_cpu_experts(dataclasses.replace(gpu, gpu=False), mixture, torch.bfloat16).cpu_gbps is None
