"""The executor on a timed simulated GPU (timed_device.TimedDevice), each streamed layer given a
Llama-70B layer's bytes over an H100's measured link and its compute: the link stays busy, the
planner's predicted step is the one simulated, and what would stall a real GPU makes the test fail."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from transformers import AutoConfig

import zerolite
from support.timed_device import DISK, H2D, H100, Rates, TimedDevice, Wait
from zerolite.layout.blocks import module_path
from zerolite.layout.folder import Layout
from zerolite.planner.cost import Candidate, Job, predict
from zerolite.planner.hardware import Hardware
from zerolite.planner.model_costs import FormatCosts, ModelCosts

LAYERS = 8
PROMPT = [5, 17, 33, 9, 44, 61, 70, 12]
NEW_TOKENS = 8
LAYER_BYTES = 1_711_276_032      # a Llama-70B decoder layer in bf16
LAYER_WEIGHTS = LAYER_BYTES // 2
HEAD_WEIGHTS = 8192 * 128256


@pytest.fixture(scope="module")
def layout(make_layout):
    return make_layout("llama", layers=LAYERS)


@dataclass(frozen=True)
class Run:
    step_s: float        # a decode step, the median over the steady ones
    link_busy: float     # the share of those steps the host-to-device link was copying
    steps: list[float]
    stalls: list[Wait]   # the host's waits on the device (not the disk's) that blocked it inside those steps' layers
    device: TimedDevice


def run_timed(layout, rates: Rates = H100, rows: int = 1, kv_gb_per_layer: float = 0.0, sabotage=None,
              launch_queue: int | None = None, **policy) -> Run:
    """Greedy decoding of NEW_TOKENS on a TimedDevice, every copy of a layer counted as a 70B layer's
    bytes and every layer's and the head's compute as theirs at rows rows a step (the tiny model runs
    batch 1; rows is what the clock charges). kv_gb_per_layer: what a layer's K/V fetch at the
    prompt's length weighs. sabotage(lm, device) may break the executor before decoding. launch_queue:
    the layers' kernels the host may queue ahead of the device (TimedDevice's; None: any)."""
    manifest = Layout.open(layout).manifest
    tiny_layer = manifest.block("layers.0").length
    device = TimedDevice(rates, disk_scale=LAYER_BYTES / tiny_layer, launch_queue=launch_queue)
    with device.watching():
        with zerolite.load(layout, device=device, show_progress=False, **policy) as lm:
            executor = lm.executor
            device.scale[executor.slots.copy_stream.name] = LAYER_BYTES / tiny_layer
            if lm.parts.caches.streams is not None:
                kv_tiny = kv_tiny_bytes(lm.model.config) * len(PROMPT)
                device.scale[lm.parts.caches.streams[0].name] = kv_gb_per_layer * 1e9 / kv_tiny
            ends, layers_from, layers_to = [], [], []
            hooks = [lm.model.get_submodule(module_path(manifest.layers_path, f"layers.{i}")).register_forward_pre_hook(
                lambda *_: device.kernel(flops=2 * rows * LAYER_WEIGHTS, nbytes=2 * LAYER_WEIGHTS))
                for i in range(LAYERS)]
            hooks.append(lm.model.lm_head.register_forward_pre_hook(
                lambda *_: device.kernel(flops=2 * rows * HEAD_WEIGHTS, nbytes=2 * HEAD_WEIGHTS)))
            hooks.append(lm.model.register_forward_hook(lambda *_: ends.append(device.compute_end())))
            # The host's time from before the executor's turn for the first layer to after its turn for the last
            first, last = (lm.model.get_submodule(module_path(manifest.layers_path, f"layers.{i}"))
                           for i in (0, LAYERS - 1))
            hooks.append(first.register_forward_pre_hook(lambda *_: layers_from.append(device.now), prepend=True))
            hooks.append(last.register_forward_hook(lambda *_: layers_to.append(device.now)))
            if sabotage is not None:
                sabotage(lm, device)
            lm.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                        pad_token_id=0)
            for hook in hooks:
                hook.remove()
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]  # decode steps after the first (the ring's steady state)
    start, end = ends[2], ends[-1]
    stalls = [wait for a, b in zip(layers_from[2:], layers_to[2:]) for wait in device.blocked(a, b)]
    return Run(sorted(steps)[len(steps) // 2], device.busy(H2D, start, end), steps, stalls, device)


def kv_tiny_bytes(config) -> int:
    """One layer's K and V for one token of the tiny model, as stored (float32)."""
    text = config.get_text_config()
    return 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4


def predicted(layout, rates: Rates, candidate: Candidate, kv_gb_per_layer: float = 0.0) -> float:
    """The planner's decode step for the same modelled model and machine."""
    config = AutoConfig.from_pretrained(Layout.open(layout).side_folder)
    tiny = ModelCosts.from_config(config, torch.bfloat16)
    kv_per_token = kv_gb_per_layer * 1e9 / len(PROMPT) * LAYERS  # over all layers, as ModelCosts counts it
    costs = replace(tiny, formats={"stored": FormatCosts(LAYER_BYTES, tiny.formats["stored"].always_bytes, 0)},
                    dense_weights=LAYER_WEIGHTS, head_weights=HEAD_WEIGHTS, attention_width=0,
                    kv_bytes_per_token=int(kv_per_token), kv_bytes_at={16: int(kv_per_token)})
    per_weight = {r: max(2 * r / (rates.tflops * 1e12), 2 / (rates.memory_gbps * 1e9)) for r in (1, 16, 64, 256, 4096,
                                                                                                 16384)}
    hardware = Hardware(gpu=True, gpu_ram=80 << 30, host_ram=1 << 40, disk_gbps=rates.disk_gbps,
                        fill_gbps=rates.disk_gbps, h2d_gbps=rates.h2d_gbps, gpu_tflops=rates.tflops,
                        compute={"stored": per_weight})
    job = Job(prompt_tokens=len(PROMPT) - 1, new_tokens=2)  # context: the prompt, as kv_gb_per_layer is sized
    return predict(costs, hardware, candidate, job).decode_step_s


def layer_bytes(layout) -> tuple[int, int]:
    """(a tiny layer's bytes, the bytes of the blocks always resident)."""
    manifest = Layout.open(layout).manifest
    return manifest.block("layers.0").length, sum(b.length for b in manifest.blocks if not b.name.startswith("layers."))


def policies(layout) -> dict[str, tuple[dict, Candidate, float]]:
    """name -> (zerolite.load's policy, the planner's candidate, each layer's K/V fetch in GB)."""
    layer, always = layer_bytes(layout)
    streamed = dict(gpu_memory=always)
    return {
        "every layer from pinned memory": (dict(offload="cpu", **streamed), Candidate("stored", 1, host_layers=8), 0.0),
        "4 resident, 4 from pinned memory": (dict(offload="cpu", gpu_memory=always + 4 * layer),
                                             Candidate("stored", 1, host_layers=4, gpu_layers=4), 0.0),
        "4 from pinned memory, 4 from disk": (dict(offload="nvme", cpu_memory=4 * (layer + 4096), **streamed),
                                              Candidate("stored", 1, host_layers=4), 0.0),
        "K/V of half the layers in host memory": (dict(offload="cpu", kv_offload=0.5, **streamed),
                                                  Candidate("stored", 1, host_layers=8, kv_offload=0.5), 0.5),
    }


@pytest.mark.parametrize("rows", [1, 4096])
def test_every_layer_streamed_from_pinned_memory_keeps_the_link_busy(layout, rows):
    """The measured H100 kept its copy stream 0.991 busy over two decode steps of 8 streamed layers
    (docs/gpu/); on the timed device the ring does at batch 1 and at 4096 rows a step, where a
    layer computes 10 ms beside its 32 ms copy. And the host never waits for the device between
    a step's first layer and its last: it queues ahead (a wait there costs nothing yet at a ring
    of two, whose copy ahead outlasts the compute, but it is a stall the moment compute is longer)."""
    policy, candidate, _ = policies(layout)["every layer from pinned memory"]
    run = run_timed(layout, rows=rows, **policy)
    assert run.link_busy >= 0.9, run
    assert run.stalls == [], run
    assert run.step_s == pytest.approx(predicted(layout, H100, replace(candidate, batch_size=rows)), rel=0.1)


@pytest.mark.parametrize("name", ["every layer from pinned memory", "4 resident, 4 from pinned memory",
                                  "4 from pinned memory, 4 from disk", "K/V of half the layers in host memory"])
def test_the_planner_predicts_the_simulated_step_within_10_percent(layout, name):
    policy, candidate, kv = policies(layout)[name]
    run = run_timed(layout, kv_gb_per_layer=kv, **policy)
    assert run.step_s == pytest.approx(predicted(layout, H100, candidate, kv), rel=0.1), run


def test_resident_layers_among_streamed_ones_keep_the_link_busy(layout):
    """Defect 1: at 5120 rows a step (a layer computes 12.5 ms, the head 15 ms, a copy takes 32 ms),
    four resident layers first kept the link 83% busy, a step of 155 ms against the 128 ms the
    copies take: the copy of the second streamed layer waits for its slot, which the first frees
    only after the resident stretch. Spread among the streamed ones, the link is busy throughout."""
    policy, candidate, _ = policies(layout)["4 resident, 4 from pinned memory"]
    run = run_timed(layout, rows=5120, **policy)
    assert run.link_busy >= 0.9, run
    assert run.step_s == pytest.approx(predicted(layout, H100, replace(candidate, batch_size=5120)), rel=0.1)
    with zerolite.load(layout, device=TimedDevice(H100), show_progress=False, **policy) as lm:
        held = [name for name in lm.plan.resident if name.startswith("layers.")]
        assert held == [f"layers.{i}" for i in (0, 2, 4, 6)]


def test_a_ring_with_a_slot_for_every_streamed_layer_moves_nothing_after_the_first_step(layout):
    """Two streamed layers in a ring of two stay in their slots: decode copies nothing, and the
    planner no longer predicts their copies (64 ms a step, against 23 ms of compute)."""
    layer, always = layer_bytes(layout)
    run = run_timed(layout, rows=1024, offload="cpu", gpu_memory=always + 6 * layer)
    assert run.link_busy == 0.0
    candidate = Candidate("stored", 1024, host_layers=2, gpu_layers=6)
    assert run.step_s == pytest.approx(predicted(layout, H100, candidate), rel=0.1), run


def test_the_disk_reads_through_the_layers_held_in_memory(layout):
    """Defect 2: six layers from pinned memory, then two from disk (489 ms of reads a step against
    257 ms of copies). The host queues a step's layers only so far ahead of the GPU: CUDA blocks a
    launch past about a thousand queued (NVIDIA's forums: "CUDA stream are blocked when launching
    lots of kernels (>1000)"), some 40 of a 70B's or BLOOM's layers of 20-30 kernels each, and
    the step's end waits for the step; here a queue of two layers' kernels. A read started only
    when the ring reached its block (the previous layer's turn) then left the disk idle while the
    GPU copied the held layers before it: a step of 587 ms, the disk 88% busy. Read ahead into
    staging buffers of their own from the step before, the disk reads throughout."""
    layer, always = layer_bytes(layout)
    run = run_timed(layout, launch_queue=2, offload="nvme", cpu_memory=6 * (layer + 4096), gpu_memory=always)
    with zerolite.load(layout, device=TimedDevice(H100), show_progress=False, offload="nvme",
                       cpu_memory=6 * (layer + 4096), gpu_memory=always) as lm:
        assert lm.plan.on_disk == ("layers.6", "layers.7")
    reads = run.device.work[DISK][-6:]  # the steady steps' (three of two reads)
    disk_pass = 2 * LAYER_BYTES / (H100.disk_gbps * 1e9)
    assert run.device.busy(DISK, reads[0][0], reads[-1][1]) >= 0.9, run
    assert run.step_s == pytest.approx(max(disk_pass, LAYERS * LAYER_BYTES / (H100.h2d_gbps * 1e9)), rel=0.1), run
    assert run.step_s == pytest.approx(predicted(layout, H100, Candidate("stored", 1, host_layers=6)), rel=0.1), run


def synchronize_in_running(lm, device):
    """A synchronize in the hot path: after a layer's bytes are bound, the host waits for the device."""
    slots = lm.executor.slots
    wait = slots.wait

    def synchronizing(name):
        data = wait(name)
        device.synchronize()
        return data

    slots.wait = synchronizing


def copies_behind_compute(lm, device):
    """Copies queued on the compute stream: each waits for the compute before it."""
    slots = lm.executor.slots
    device.scale[device.compute.name] = device.scale[slots.copy_stream.name]
    slots.copy_stream = device.compute


def scalar_read_in_a_layer(lm, device):
    """A hidden .item(): a layer checks its input on the host (a NaN check, say)."""
    def check(module, args, kwargs):
        (args[0] if args else kwargs["hidden_states"]).isnan().any().item()

    layer = lm.model.get_submodule(module_path(lm.layout.manifest.layers_path, "layers.3"))
    layer.register_forward_pre_hook(check, with_kwargs=True)


@pytest.mark.parametrize("sabotage, stall, idles", [(synchronize_in_running, "event", True),
                                                    (copies_behind_compute, None, True),
                                                    (scalar_read_in_a_layer, "scalar", False)])
def test_a_synchronisation_in_the_hot_path_or_a_copy_behind_compute_stalls_the_step(layout, sabotage, stall, idles):
    """What would stall a real GPU stalls the timed one, and the decode test above then fails: a
    synchronize idles the link (a step of 349 ms against 257, 74% busy) and blocks the host;
    copies behind compute idle it; a hidden .item() leaves it busy (at a ring of two the copy
    queued ahead outlasts the compute the host waits for) but blocks the host inside the step."""
    policy, _, _ = policies(layout)["every layer from pinned memory"]
    run = run_timed(layout, rows=4096, sabotage=sabotage, **policy)
    assert (run.link_busy < 0.9) == idles, run
    assert {wait.kind for wait in run.stalls} == ({stall} if stall else set()), run
