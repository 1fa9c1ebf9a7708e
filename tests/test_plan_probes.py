"""The planner's probes kept true to this machine: one timed while other work took the cores is marked
so and timed again once the machine is quiet; stored weights are timed through the kernel a CPU run
computes them with; the probe of the model's own layer overrules matmul rates that price its layer
higher; and attention over the K/V is priced at the rate its own probe streams it at, not a matmul's."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from zerolite.io.device import CpuDevice
from zerolite.planner import contention, hardware, kv_probe, measurements
from zerolite.planner.compute_probe import LAYER_CONTEXT, filled_model, module_for
from zerolite.planner.cost import Candidate, Job, Rates, predict
from zerolite.planner.hardware import Hardware, probed
from zerolite.planner.kv_costs import kv_step
from zerolite.planner.model_costs import ModelCosts
from zerolite.quant.bf16_linear import Bf16KernelLinear

ROWS = (1, 4, 16, 64, 256, 1024)


def llama(**overrides) -> ModelCosts:
    config = AutoConfig.for_model("llama", **{**dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                                     num_attention_heads=8, vocab_size=1000), **overrides})
    return ModelCosts.from_config(config, torch.bfloat16, "llama")


def cpu(per_weight: float, **overrides) -> Hardware:
    figures = dict(gpu=False, gpu_ram=0, host_ram=64 << 30, disk_gbps=2.0, fill_gbps=2.0, h2d_gbps=None,
                   gpu_tflops=None, compute={w: {r: per_weight for r in ROWS} for w in ("stored", "int8", "int4")},
                   attention_gbps=20.0)
    return Hardware(**{**figures, **overrides})


def clock(*readings):
    """contention's view of the machine, reading by reading: (CPU seconds of /proc/stat, CPUs,
    this process's CPU seconds, wall seconds)."""
    stat = iter([(busy, cpus) for busy, cpus, _, _ in readings])
    own, wall = iter([r[2] for r in readings]), iter([r[3] for r in readings])
    return (lambda: next(stat)), SimpleNamespace(process_time=lambda: next(own), perf_counter=lambda: next(wall))


@pytest.mark.parametrize("busy, own, threads, quiet", [
    (1.6, 0.5, 2, False),  # others took 1.1 cores of the 2 both threads needed
    (0.7, 0.5, 2, True),   # 0.2 cores: background
    (1.6, 0.5, 1, True),   # one thread leaves one core spare: others' core is that one
])
def test_others_use_of_the_cores_is_every_cpus_busy_time_less_this_process(monkeypatch, busy, own, threads, quiet):
    stat, clocks = clock((100.0, 2, 10.0, 0.0), (100.0 + busy, 2, 10.0 + own, 1.0))
    monkeypatch.setattr(contention, "cpu_seconds", stat)
    monkeypatch.setattr(contention, "time", clocks)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    with contention.Contention() as load:
        pass
    assert load.others_cores == pytest.approx(busy - own) and load.quiet == quiet


def test_a_machine_kept_busy_by_other_processes_is_seen_busy():
    """Real /proc/stat: a busy loop on every CPU, while this process waits."""
    cpus = contention.cpu_seconds()[1]
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    try:
        time.sleep(0.1)  # started
        assert not contention.quiet_now()
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def test_a_probe_timed_on_a_busy_machine_serves_until_a_plan_finds_the_machine_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    load = SimpleNamespace(quiet=False, others_cores=1.5)

    class Watched:
        def __enter__(self):
            return load

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(hardware, "Contention", Watched)
    timed = []

    def probe() -> float:
        timed.append(True)
        return 10.0 * len(timed)

    def plan() -> tuple:
        return probed("key", "attention", probe, None, "attention")

    assert plan() == (10.0, "measured now, while other work took 1.5 cores: to be measured again")
    assert measurements.recorded_entry("key", "attention")["busy"]["others_cores"] == 1.5
    assert plan() == (10.0, "recorded")  # not RETRY_S since
    monkeypatch.setattr(measurements, "RETRY_S", 0)
    monkeypatch.setattr(measurements, "quiet_now", lambda: False)
    assert plan() == (10.0, "recorded")  # still busy: probing again would time the same load
    monkeypatch.setattr(measurements, "quiet_now", lambda: True)
    load.quiet = True
    assert plan() == (20.0, "measured now") and "busy" not in measurements.recorded_entry("key", "attention")
    assert plan() == (20.0, "recorded") and len(timed) == 2


def test_stored_weights_are_timed_through_the_kernel_a_cpu_run_computes_them_with():
    """zerolite.runtime.parts swaps a CPU run's nn.Linear for the bf16 kernel's: torch's bf16 path
    timed instead once read its weights at a third of the kernel's rate."""
    assert type(module_for("stored", torch.zeros(8, 16, dtype=torch.bfloat16), CpuDevice())) is Bf16KernelLinear
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, vocab_size=128)
    linears = [type(m) for m in filled_model(config, torch.bfloat16, CpuDevice()).modules() if isinstance(m, nn.Linear)]
    assert linears and set(linears) == {Bf16KernelLinear}


def test_the_models_own_layer_probe_overrules_matmul_rates_that_price_its_layer_higher():
    costs = llama()
    probe = {1: 0.002, 16: 0.0025}
    slow = cpu(1e-9, layer_seconds=probe, step_seconds={1: 0.0, 16: 0.0})  # 1 ns a weight: 2.6 ms a layer's matmuls
    rates = Rates(costs, slow)
    assert rates.probed_matmuls("stored", 1, LAYER_CONTEXT) > 0.002
    for rows in (1, 4, 16):
        assert rates.layer("stored", rows, LAYER_CONTEXT, prefill=False) == pytest.approx(hardware.at(probe, rows))
    # past the rows probed, the stored rates keep the share they were brought down by at the last
    share = probe[16] / rates.probed_matmuls("stored", 16, LAYER_CONTEXT)
    assert rates.matmuls("stored", 64, 100) == pytest.approx(share * rates.probed_matmuls("stored", 64, 100))
    assert rates.matmuls("int8", 1, 100) == rates.probed_matmuls("int8", 1, 100)  # the layer probe is of stored weights
    # matmuls the layer probe outlasts keep their rates, the rest of the layer beside them
    fast = Rates(costs, cpu(1e-13, layer_seconds=probe, step_seconds={1: 0.0, 16: 0.0}))
    assert fast.matmuls("stored", 1, 100) == fast.probed_matmuls("stored", 1, 100)
    assert fast.layer("stored", 1, LAYER_CONTEXT, prefill=False) == pytest.approx(0.002)
    step = predict(costs, slow, Candidate("stored", 1, host_layers=4), Job(1, 2)).compute_s
    assert step < 4 * 0.002 + costs.head_weights * 1e-9  # the head's matmul brought down alike


def test_attention_is_priced_at_its_own_probes_rate_not_a_matmuls():
    costs, context = llama(), 600.0
    dense = 8 * context * costs.kv_bytes(16)
    for per_weight in (1e-9, 1e-12):  # whatever the matmuls stream at
        step = kv_step(costs, cpu(per_weight), Candidate("stored", 8, 4), 8, context, prefill=False)
        assert step.compute_s == pytest.approx(3 * dense / 20e9)  # appended (read, written) and read


def test_the_attention_probe_times_a_decode_steps_append_and_read(monkeypatch):
    monkeypatch.setattr(kv_probe, "SHAPE", (2, 2, 64, 16))  # the real one streams 128 MB: seconds on a busy machine
    monkeypatch.setattr(kv_probe, "ATTENDED_LAYERS", 2)
    assert 0 < kv_probe.probe_attention(CpuDevice(), torch.bfloat16) < 1e4
