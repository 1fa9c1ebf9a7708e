"""Mixtures of experts through transformers' own MoE modules (the fused 3-D expert tensors): each
layer's dense part streams as a block, and only the experts the router picks are read (or copied),
into their rows of the bound expert tensors. Greedy tokens and logits equal transformers' on the
same weights in RAM, one prompt and a padded batch, from disk and from host memory, at every ring
depth; a step reads exactly the dense parts and the routed experts."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from transformers import GenerationMixin

import zerolite
from support.helpers import greedy
from support.simulated_device import OrderingError, SimulatedDevice
from support.tiny_models import MOE_SHAPES, WHOLE_MOE_SHAPES
from test_executor import (
    BATCH,
    MORE_SETUPS,
    NEW_TOKENS,
    SETUPS,
    SINGLE,
    assert_same_generation,
    check_equal,
    layout_and_reference,
)
from zerolite.cli.plan_summary import summarize
from zerolite.errors import ZeroliteError
from zerolite.layout.folder import Layout
from zerolite.moe.experts import find_experts
from zerolite.runtime.budget import Budgets
from zerolite.runtime.parts import host_expert_layers
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy
from zerolite.runtime.slots import Slots

NVME = dict(offload="nvme", cpu_memory=0, device="cpu", show_progress=False)


@pytest.fixture(scope="module", params=list(MOE_SHAPES))
def tiny(request, make_source, make_layout):
    return layout_and_reference(request.param, make_source, make_layout)


def test_the_tiny_experts_are_routed_apart(tiny):
    """Generation varies: a wrong expert's weights would show in the tokens."""
    _, reference = tiny
    new = reference("cpu")[1].sequences[:, -NEW_TOKENS:]
    assert len(set(new.flatten().tolist())) >= 4, new


def mixture_layers(layout) -> list:
    """The layers holding experts: every one but a dense first few (DeepSeek-V3's and GLM-4.5's
    first_k_dense_replace)."""
    return [b for b in Layout.open(layout).manifest.blocks if b.name.startswith("layers.") and b.experts is not None]


def test_every_layer_keeps_each_expert_in_an_extent_of_its_own(tiny):
    layout, _ = tiny
    layers = [b for b in Layout.open(layout).manifest.blocks if b.name.startswith("layers.")]
    dense = json.loads((layout / "config.json").read_text()).get("first_k_dense_replace", 0)
    assert [b.experts is None for b in layers] == [i < dense for i in range(len(layers))]
    for block in layers[dense:]:
        assert block.experts.count == 8
        assert block.experts.offset == block.dense_length < block.length


def test_layers_read_per_expert_stay_one_stretch_on_a_cpu_so_each_guesses_the_next(tiny):
    """Plan.make spreads a CPU's disk layers among the held ones, but a layer read per expert guesses
    the next one's experts only if that one is read per expert too (zerolite.moe.routing)."""
    manifest = Layout.open(tiny[0]).manifest
    layers = list(manifest.layer_names)
    half = Budgets(device=0, host=len(layers) // 2 * max(manifest.block(name).length for name in layers))
    routed = Plan.make(manifest, Policy(offload="nvme", device="cpu", experts="routed"), half)
    assert routed.on_disk == tuple(layers[len(layers) // 2:])
    whole = Plan.make(manifest, Policy(offload="nvme", device="cpu", experts="whole"), half)
    assert whole.on_disk != routed.on_disk and len(whole.on_disk) == len(routed.on_disk)


# What a GPU does alike for every family, on three of its layouts: experts fused, transposed with
# biases, and beside a shared expert and a dense first layer.
ON_A_GPU_ALIKE = ["mixtral", "gpt_oss", "deepseek_v3"]


# Every family at depth 2 (reads ahead, guesses); the ring's other depths on a few: the later
# families bring layouts (fused, transposed, shared experts, a dense first layer), not schedules.
def depths(swept: tuple[str, ...]) -> list:
    return [pytest.param(arch, 2, id=f"{arch}-2") for arch in MOE_SHAPES] + [
        pytest.param(arch, depth, id=f"{arch}-{depth}") for arch in swept for depth in (1, 4)]


def on_a_cpu() -> list:
    """From disk, depths(...); from host memory, where a CPU binds the layers where they lie and
    reads nothing ahead (test_executor.ring_cases), every family at depth 2."""
    return [pytest.param("nvme", *case.values, id=f"nvme-{case.id}") for case in depths(("mixtral", "qwen2_moe",
                                                                                           "gpt_oss"))] + [
        pytest.param("cpu", arch, 2, id=f"cpu-{arch}-2") for arch in MOE_SHAPES]


@pytest.mark.parametrize("setup, tiny, depth", on_a_cpu(), indirect=["tiny"])
def test_moe_generation_streamed_per_expert_equals_transformers(tiny, setup, depth):
    check_equal(tiny, SETUPS[setup], depth, "cpu")


def on_a_gpu() -> list:
    """Mixtral from disk and from host memory at every depth; each later family (a layout, not a
    schedule: see depths) at depth 2 from one of the two, taking turns, so that both see fused,
    transposed and shared-expert layouts."""
    setups = ("nvme", "cpu")
    cases = [pytest.param(setup, "mixtral", depth, id=f"{setup}-mixtral-{depth}") for setup in setups
             for depth in (1, 2, 4)]
    later = [arch for arch in MOE_SHAPES if arch != "mixtral"]
    return cases + [pytest.param(setups[i % 2], arch, 2, id=f"{setups[i % 2]}-{arch}-2")
                    for i, arch in enumerate(later)]


@pytest.mark.cuda
@pytest.mark.parametrize("setup, tiny, depth", on_a_gpu(), indirect=["tiny"])
def test_moe_generation_on_a_gpu_copies_only_routed_experts_and_equals_transformers(setup, tiny, depth, gpu):
    """From host memory too: a GPU copies the dense part and the routed experts only, every layer
    through the ring (no GPU memory for resident layers), each expert copied into its own byte range
    of the slot, which the simulated device's ledger checks range by range."""
    layout, _ = tiny
    layers = [b.name for b in Layout.open(layout).manifest.blocks if b.name.startswith("layers.")]

    def every_layer_per_expert(lm):
        assert lm.per_expert == frozenset(b.name for b in mixture_layers(layout))

    check_equal(tiny, {**SETUPS[setup], "gpu_memory": 0}, depth, gpu, streamed=len(layers),
                check=every_layer_per_expert)


def record_routing(lm) -> list[list[set[int]]]:
    """Per forward, per layer with experts: the experts its router picked (the union over the batch)."""
    forwards: list[list[set[int]]] = []
    layers = [layer for layer in lm.model.get_submodule(lm.layout.manifest.layers_path) if find_experts(layer)]

    def saw(index: int):
        def hook(module, args):
            if index == 0:
                forwards.append([])
            forwards[-1].append(set(args[1].flatten().tolist()))
        return hook

    for index, layer in enumerate(layers):
        # prepended: before zerolite's
        layer.get_submodule(find_experts(layer).path).register_forward_pre_hook(saw(index), prepend=True)
    return forwards


def test_a_step_reads_the_dense_parts_and_the_routed_experts_exactly(tiny):
    """Depth 1: no read ahead and no guess, so every byte read is one a step needed."""
    layout, reference = tiny
    blocks = mixture_layers(layout)
    dense = sum(b.length for b in Layout.open(layout).manifest.blocks
                if b.name.startswith("layers.") and b not in blocks)
    with zerolite.load(layout, prefetch_depth=1, **NVME) as lm:
        forwards = record_routing(lm)
        before = lm.bytes_read
        assert_same_generation(reference("cpu")[1], greedy(lm, BATCH, NEW_TOKENS, logits=True))
        read = lm.bytes_read - before
        expected = sum(block.dense_length + len(routed) * block.experts.stride
                       for layers in forwards for block, routed in zip(blocks, layers, strict=True))
        assert read == expected + len(forwards) * dense
        assert lm.expert_counts().expert_bytes == expected - len(forwards) * sum(b.dense_length for b in blocks)
        # decode steps of one token over 8 experts, top-2: at most 2 per layer for the single prompt
        assert read < len(forwards) * (sum(b.length for b in blocks) + dense)


def test_whole_streams_every_expert_and_gives_the_same_tokens(tiny):
    layout, reference = tiny
    blocks = [b for b in Layout.open(layout).manifest.blocks if b.name.startswith("layers.")]
    with zerolite.load(layout, prefetch_depth=1, experts="whole", **NVME) as lm:
        assert_same_generation(reference("cpu")[0], greedy(lm, SINGLE, NEW_TOKENS, logits=True))
        assert lm.bytes_read == NEW_TOKENS * sum(b.length for b in blocks)
        assert lm.expert_counts().expert_bytes == 0


def test_guessed_experts_read_ahead_leave_the_tokens_unchanged(tiny, monkeypatch):
    """The next layer's experts guessed from its router and read early, whether right or wrong
    (trusted from the first guess here): the tokens stay exact, and the bytes read are the dense
    parts, the routed experts and the guessed ones the router did not pick, less what of their
    reads was given up before it started (and, at the end, the ring's read ahead of the next
    forward's first dense part)."""
    monkeypatch.setattr("zerolite.moe.guess.RELIABLE", 0.0)
    layout, reference = tiny
    layers = [b for b in Layout.open(layout).manifest.blocks if b.name.startswith("layers.")]
    blocks = mixture_layers(layout)
    stride = blocks[0].experts.stride
    with zerolite.load(layout, prefetch_depth=2, **NVME) as lm:
        forwards = record_routing(lm)
        assert_same_generation(reference("cpu")[1], greedy(lm, BATCH, NEW_TOKENS, logits=True))
        counts = lm.expert_counts()
        assert counts.guessed > 0 and 0 < counts.guessed_right <= counts.guessed
        routed = sum(block.dense_length + len(experts) * stride
                     for routing in forwards for block, experts in zip(blocks, routing, strict=True))
        dense = sum(b.length for b in layers if b not in blocks)  # a dense first layer's, each forward
        assert lm.bytes_read + counts.spared_bytes == (routed + len(forwards) * dense + counts.early_unused * stride
                                                       + layers[0].dense_length)
        assert_same_generation(reference("cpu")[0], greedy(lm, SINGLE, NEW_TOKENS, logits=True))


@pytest.mark.parametrize("tiny", ON_A_GPU_ALIKE, indirect=True)
def test_generate_on_a_simulated_gpu_saying_cuda_decodes_with_the_experts_implementation_it_was_built_with(tiny):
    """The simulated device in its reports_cuda mode: transformers sees a model on "cuda" and takes
    its GPU branches, the decode-time swap among them; every forward still runs what the model was
    built with, and the tokens are transformers' on the CPU."""
    assert hasattr(GenerationMixin, "_optimize_model_for_decode"), "transformers renamed the switch: find it again"
    layout, reference = tiny
    expected = reference("cpu")[0]
    sim = SimulatedDevice(seed=5, reports_cuda=True)
    with sim.watching(), zerolite.load(layout, prefetch_depth=2, **{**NVME, "device": sim, "gpu_memory": 0}) as lm:
        assert lm.model.device.type == "cuda"
        built = lm.model.get_experts_implementation()
        seen = []
        lm.model.register_forward_pre_hook(lambda model, args: seen.append(model.get_experts_implementation()))
        assert_same_generation(expected, greedy(lm, SINGLE, NEW_TOKENS, logits=True))
        assert len(seen) == NEW_TOKENS and all(implementation == built for implementation in seen), seen


@pytest.mark.parametrize("setup", ["nvme", "cpu"])
def test_on_a_gpu_expert_copies_run_on_a_stream_apart_from_the_dense_parts(make_source, make_layout, setup):
    """A layer's experts are known only once its router runs; on the copy stream that carries the
    dense parts read ahead for the next layers they would queue behind those. On the simulated
    device every copy into a slot is recorded with its stream: a dense part's from the slot's
    first byte, an expert's from its extent in the expert area. From disk and from host memory,
    the two never share a stream, and the tokens are transformers'."""
    layout, reference = layout_and_reference("mixtral", make_source, make_layout)
    sim = SimulatedDevice(seed=11, max_delay_s=2e-4)  # shorter lags: many copies, kept quick
    streams = {"dense": set(), "experts": set()}
    with sim.watching(), zerolite.load(layout, prefetch_depth=3, **{**NVME, **SETUPS[setup], "device": sim,
                                                                    "gpu_memory": 0}) as lm:
        assert lm.per_expert
        slots = {slot.device.untyped_storage().data_ptr(): slot.device.data_ptr() for slot in lm.executor.slots._slots}
        copy = sim.copy

        def recorded(dst, src, stream):
            first = slots.get(dst.untyped_storage().data_ptr())
            if first is not None:
                streams["experts" if dst.data_ptr() > first else "dense"].add(stream.name)
            copy(dst, src, stream)

        sim.copy = recorded
        assert_same_generation(reference("cpu")[1], greedy(lm, BATCH, NEW_TOKENS, logits=True))
    assert streams["dense"] and streams["experts"] and not streams["dense"] & streams["experts"], streams


def test_each_layer_routed_per_expert_waits_for_the_device_once(tiny, monkeypatch):
    """Its routing and the next layer's guess go to the host together: each answer taken there
    (tolist, item, cpu) makes the host wait for the GPU, which it should rather keep queueing ahead of."""
    layout, reference = tiny
    taken = []

    def counting(method: str):
        real = getattr(torch.Tensor, method)

        def counted(tensor, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("zerolite.moe"):
                taken.append(method)
            return real(tensor, *args, **kwargs)
        return counted

    for method in ("tolist", "item", "cpu"):
        monkeypatch.setattr(torch.Tensor, method, counting(method))
    with zerolite.load(layout, prefetch_depth=2, **NVME) as lm:
        forwards = record_routing(lm)
        assert_same_generation(reference("cpu")[1], greedy(lm, BATCH, NEW_TOKENS, logits=True))
        assert lm.expert_counts().guessed > 0  # the guess ran beside the routing
    assert len(taken) == sum(map(len, forwards))


# top-4 on three mixtures (the others' routing is top-2's, which every family runs)
@pytest.mark.parametrize("arch, top_k", [(arch, 2) for arch in MOE_SHAPES]
                         + [(arch, 4) for arch in ("mixtral", "gpt_oss", "deepseek_v3")])
def test_one_tokens_experts_computed_apart_equal_one_call_bit_for_bit(arch, top_k, make_layout, monkeypatch):
    """At batch 1 on a CPU, in bfloat16, each of a token's top_k experts computes as it lands while
    the others still read (ExpertRouting.routing). Forced at every layer of every decode step, the
    logits equal those of the layers streamed whole (one call of the experts module per layer) bit
    for bit."""
    layout = make_layout(arch, layers=4, dtype="bf16", **({"num_experts_per_tok": top_k} if top_k != 2 else {}))
    with zerolite.load(layout, prefetch_depth=2, experts="whole", **NVME) as lm:
        whole = greedy(lm, SINGLE, NEW_TOKENS, logits=True)
    first_here = Slots.first_here
    apart = []

    def other_still_reading(self, name, experts):
        apart.append(name)
        return first_here(self, name, experts)[0], False

    monkeypatch.setattr(Slots, "first_here", other_still_reading)
    with zerolite.load(layout, prefetch_depth=2, **NVME) as lm:
        split = greedy(lm, SINGLE, NEW_TOKENS, logits=True)
    assert len(apart) >= (NEW_TOKENS - 1) * (top_k - 1)  # each decode step's token's experts but the last
    assert torch.equal(split.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(split.logits, whole.logits, strict=True))


def test_the_expert_cache_serves_experts_read_before(tiny):
    """A host budget smaller than a layer keeps experts instead; hits copy them into the slot."""
    layout, reference = tiny
    stride = mixture_layers(layout)[0].experts.stride
    with zerolite.load(layout, prefetch_depth=2, **{**NVME, "cpu_memory": 6 * stride}) as lm:
        assert lm.plan.in_memory == () and lm.plan.expert_cache == 6 * stride
        for expected, rows in zip(reference("cpu"), (SINGLE, BATCH)):
            assert_same_generation(expected, greedy(lm, rows, NEW_TOKENS, logits=True))
        counts = lm.expert_counts()
        assert 0 < counts.cache_hits < counts.cache_lookups


@pytest.mark.parametrize("tiny", ON_A_GPU_ALIKE, indirect=True)
def test_on_a_gpu_the_expert_cache_pins_nothing_while_generating(tiny):
    """Its entries are only ever copied from on the host (a hit lands in the slot's pinned read
    buffer first): pinning each as it is made would register memory on the hot path. (The ledger
    is left off: it tracks whole buffers, and a slot's experts share one.)"""
    layout, reference = tiny
    stride = mixture_layers(layout)[0].experts.stride
    sim = SimulatedDevice(seed=1)
    with zerolite.load(layout, prefetch_depth=2,
                       **{**NVME, "device": sim, "gpu_memory": 0, "cpu_memory": 6 * stride}) as lm:
        assert lm.plan.expert_cache == 6 * stride
        pinned = sim.pinned
        for expected, rows in zip(reference("cpu"), (SINGLE, BATCH)):
            assert_same_generation(expected, greedy(lm, rows, NEW_TOKENS, logits=True))
        assert lm.expert_counts().cache_hits > 0
        assert sim.pinned == pinned


def test_a_damaged_expert_is_refused_by_its_checksum(tiny, tmp_path):
    layout, _ = tiny
    copy = tmp_path / "layout"
    shutil.copytree(layout, copy)
    manifest = Layout.open(copy).manifest
    for block in manifest.blocks:
        if block.experts is not None:
            for expert in range(block.experts.count):
                start, _ = block.experts.extent(expert)
                with open(copy / manifest.data_file, "r+b") as data:
                    data.seek(block.offset + start + 100)
                    byte = data.read(1)
                    data.seek(block.offset + start + 100)
                    data.write(bytes([byte[0] ^ 0xFF]))
    with zerolite.load(copy, prefetch_depth=2, **NVME) as lm:
        with pytest.raises(ZeroliteError, match=r"expert \d+\) of layout .* fails its checksum"):
            greedy(lm, SINGLE, NEW_TOKENS, logits=True)


@pytest.mark.parametrize(("arch", "kind"), [("jetmoe", "JetMoeParallelExperts"), ("llama4_text", "Llama4TextExperts")])
def test_experts_not_called_with_their_routing_stream_whole_with_one_line(make_source, make_layout, capsys, arch, kind):
    """JetMoe's ParallelExperts take token counts, not the routing; Llama 4's experts run every
    expert over every token: their layers stream whole, said once, and the tokens are transformers'."""
    assert set(WHOLE_MOE_SHAPES) == {"jetmoe", "llama4_text"}
    layout, reference = layout_and_reference(arch, make_source, make_layout)
    with zerolite.load(layout, prefetch_depth=2, **NVME) as lm:
        assert lm.per_expert == frozenset()
        assert_same_generation(reference("cpu")[1], greedy(lm, BATCH, NEW_TOKENS, logits=True))
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"zerolite: {arch}'s layers stream whole, every expert at every step: its experts module "
                     f"({kind}) is not called with the router's choice"]
    assert all(b.experts is None for b in Layout.open(layout).manifest.blocks)


def test_an_unknown_experts_choice_is_one_clear_error(tiny):
    layout, _ = tiny
    with pytest.raises(ZeroliteError, match="unknown `experts` 'some': choose one of routed, whole"):
        zerolite.load(layout, experts="some", **NVME)


@pytest.mark.cuda
def test_keys_and_values_of_different_widths_in_host_memory_equal_transformers(make_source, make_layout, gpu):
    """DeepSeek-V3's attention caches its compressed latent (kv_lora_rank wide) and its rotary key
    part (qk_rope_head_dim) as a layer's keys and values: every layer's K/V in host memory, each in
    host buffers of its own width (a buffer shaped by the keys alone took the values' copy wrong)."""
    check_equal(layout_and_reference("deepseek_v3", make_source, make_layout), MORE_SETUPS["kv-1.0"], 2, gpu)


def expert_copies(sim: SimulatedDevice, lm, counted: list) -> None:
    """Records in counted the bytes of every copy into a slot's expert area (from the first expert's
    offset on: a dense part's copy starts at the slot's first byte)."""
    first = min(block.experts.offset for block in mixture_layers(lm.layout.folder))
    slots = {slot.device.untyped_storage().data_ptr(): slot.device.data_ptr() for slot in lm.executor.slots._slots}
    copy = sim.copy

    def recorded(dst, src, stream):
        start = slots.get(dst.untyped_storage().data_ptr())
        if start is not None and dst.data_ptr() - start >= first:
            counted.append(dst.nbytes)
        copy(dst, src, stream)

    sim.copy = recorded


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("setup", ["nvme", "cpu"])
def test_experts_on_the_cpu_move_no_expert_over_the_link_and_equal_transformers(arch, setup, make_source, make_layout):
    """`experts` cpu on a GPU: the host computes each layer's routed experts from their bytes in host
    memory (held there, or read from disk into the slot's host buffer), the hidden states going over
    and the outputs back; no copy lands in a slot's expert area (the simulated device sees every
    copy), and the tokens and logits are transformers', as with the experts moved to the device.
    DeepSeek-V3: fused gate_up, a shared expert and a dense first layer on the device; gpt-oss:
    transposed experts with biases."""
    layout, reference = layout_and_reference(arch, make_source, make_layout)
    moved = {}
    for experts in ("device", "cpu"):
        sim = SimulatedDevice(seed=7, max_delay_s=2e-4)
        counted = []
        with sim.watching(), zerolite.load(layout, prefetch_depth=2, experts=experts,
                                           **{**NVME, **SETUPS[setup], "device": sim, "gpu_memory": 0}) as lm:
            assert lm.per_expert == frozenset(b.name for b in mixture_layers(layout))
            assert lm.host_experts == (lm.per_expert if experts == "cpu" else frozenset())
            said = [line for line in summarize(lm) if line.startswith("experts on the CPU: ")]
            assert len(said) == (experts == "cpu"), summarize(lm)
            expert_copies(sim, lm, counted)
            assert_same_generation(reference("cpu")[1], greedy(lm, BATCH, NEW_TOKENS, logits=True))
            moved[experts] = (sum(counted), lm.executor.slots.expert_bytes_copied)
            # their experts never go to the device: its slots hold the widest dense part alone
            widest = max(b.dense_length if experts == "cpu" else b.length
                         for b in Layout.open(layout).manifest.blocks if b.name in lm.plan.streamed)
            assert {slot.device.numel() for slot in lm.executor.slots._slots} == {widest}
    assert moved["device"][0] > 0 and moved["device"][1] > 0, moved
    assert moved["cpu"] == (0, 0), moved


def test_the_pinned_count_of_layers_on_the_cpu_is_the_one_generation_runs(make_source, make_layout):
    """`experts` cpu with cpu_expert_layers 2 (what zerolite plan gives generate for a split): the
    host computes two layers' experts, spread among the others, whose experts the link brings; the
    tokens are transformers'."""
    layout, reference = layout_and_reference("gpt_oss", make_source, make_layout)
    layers = [b.name for b in mixture_layers(layout)]
    assert len(layers) == 6
    sim = SimulatedDevice(seed=3, max_delay_s=2e-4)
    with sim.watching(), zerolite.load(layout, prefetch_depth=2, experts="cpu", cpu_expert_layers=2,
                                       **{**NVME, **SETUPS["cpu"], "device": sim, "gpu_memory": 0}) as lm:
        assert lm.host_experts == {layers[1], layers[4]}
        assert_same_generation(reference("cpu")[0], greedy(lm, SINGLE, NEW_TOKENS, logits=True))
        assert lm.executor.slots.expert_bytes_copied > 0
        said = [line for line in summarize(lm) if line.startswith("experts on the CPU: ")]
        assert len(said) == 1 and "of 2 layers" in said[0], said


def test_auto_without_a_plan_moves_the_experts_to_the_device_and_a_count_needs_experts_cpu():
    """auto is what generate's plan resolves; loaded without one, the experts go to the device (as
    routed); on a CPU every choice computes them where they live."""
    layers, per_expert = ["layers.0", "layers.1"], frozenset({"layers.0", "layers.1"})
    assert host_expert_layers(per_expert, layers, Policy(experts="auto"), separate_memory=True) == frozenset()
    assert host_expert_layers(per_expert, layers, Policy(experts="cpu"), separate_memory=False) == frozenset()
    assert host_expert_layers(per_expert, layers, Policy(experts="cpu"), separate_memory=True) == per_expert
    with pytest.raises(ZeroliteError, match="`cpu_expert_layers` counts the layers whose experts the CPU computes: "
                                            "give 0 or more with `experts` cpu, not 2 with routed"):
        Policy(experts="device", cpu_expert_layers=2)


def test_without_the_wait_for_the_hosts_expert_output_the_device_reads_it_early(make_source, make_layout, monkeypatch):
    """The device's use of the host's expert output waits for its copy back: without that wait the
    simulated device's ledger sees compute read the output before the copy that fills it."""
    layout, _ = layout_and_reference("deepseek_v3", make_source, make_layout)
    from zerolite.moe import host_experts

    class NoWait:
        def __init__(self, device):
            self.device = device

        def wait_event(self, stream, event):
            pass  # the one wait removed

        def __getattr__(self, name):
            return getattr(self.device, name)

    real = host_experts.HostExperts.__init__

    def without_the_wait(self, manifest, device):
        real(self, manifest, NoWait(device))

    monkeypatch.setattr(host_experts.HostExperts, "__init__", without_the_wait)
    sim = SimulatedDevice(seed=7, max_delay_s=2e-4)
    with pytest.raises(OrderingError, match="compute reads a device buffer before the copy"):
        with sim.watching(), zerolite.load(layout, prefetch_depth=2, experts="cpu",
                                           **{**NVME, "device": sim, "gpu_memory": 0}) as lm:
            greedy(lm, SINGLE, 2)
