"""A mixture's checkpoint streamed in place, per expert: the checkpoint's per-expert tensors (as
the hub publishes them, and as save_pretrained writes them) placed into each expert's extent as
it is read, exactly as a converted layout holds it; only the routed experts read, each from its
own parts of the shards; the same tokens as transformers and as the converted layout."""

from __future__ import annotations

import copy
import zlib
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import Transpose, WeightConverter

import zerolite
import zerolite.convert.in_place
from support.helpers import greedy
from support.simulated_device import SimulatedDevice
from test_executor import reference_device
from test_in_place import ROWS, files_under, streamed_in_place
from test_moe import record_routing
from zerolite.convert.checkpoint import Checkpoint, safetensors_header
from zerolite.convert.in_place import NotInPlace, plan_in_place, record_checksums, write_in_place
from zerolite.hf import keep_experts_implementation
from zerolite.io.engine import ALIGNMENT, IoEngine, aligned_empty
from zerolite.layout.expert_parts import expert_read
from zerolite.layout.folder import Layout, tensor_views
from zerolite.layout.manifest import BlockEntry, ExpertArea, TensorEntry
from zerolite.layout.placement import device_placement
from zerolite.layout.store import DiskStore

NEW_TOKENS = 3


def reference(source, device: str = "cpu"):
    """transformers' tokens, its weights copied out of safetensors' mmap (where some CPU kernels
    round differently) and the experts' kernel kept as built, as zerolite keeps it."""
    model = AutoModelForCausalLM.from_pretrained(source).eval().to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    keep_experts_implementation(model)
    return greedy(model, ROWS, NEW_TOKENS, device=device).cpu()


def test_the_tiny_checkpoints_store_experts_as_the_hub_does(make_source):
    """Per expert and matrix (Mixtral's w1/w2/w3, Qwen's and DeepSeek-V3's gate/up/down), which
    transformers fuses while loading; gpt_oss's fused already."""
    def keys(arch):
        _, header = safetensors_header(make_source(arch, layers=3) / "model.safetensors")
        return set(header)

    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in keys("mixtral")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys("deepseek_v3")
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys("gpt_oss")


# Mixtral's tiny tensors are 6144 bytes: each expert's lie at another offset within their pages, so
# they are read through scratch (as the test below streams them); with intermediate_size 32 (8192
# bytes) every expert's lie alike, and their whole pages are read straight into the extent.
# gpt_oss's gate_up_proj slices alike, the rest not.
@pytest.mark.parametrize("arch, config", [("mixtral", dict(intermediate_size=32)), ("gpt_oss", {})])
def test_each_expert_read_in_place_holds_the_converted_layouts_bytes(make_source, make_layout, tmp_path,
                                                                     monkeypatch, arch, config):
    """Mixtral's gate_up_proj is w1 then w3 of the expert, with w2 between them in the shard: every
    expert's slices read in place, a layer whole (one expert at a time through scratch) or an
    expert alone, are the converted layout's (transformers' own); `zerolite verify` records each
    expert's checksum, which reading it alone or the layer cut inside an expert matches."""
    source = make_source(arch, layers=3, **config)
    write_in_place(plan_in_place(Checkpoint.open(str(source), False), None), tmp_path)
    monkeypatch.setattr("zerolite.layout.store.SCRATCH_LIMIT", 1)  # whole layers read an expert at a time
    record_checksums(Layout.open(tmp_path), show_progress=False)
    in_place, converted = Layout.open(tmp_path).manifest, Layout.open(make_layout(arch, layers=3, **config))
    disk, converted_disk = DiskStore(Layout.open(tmp_path), IoEngine()), DiskStore(converted, IoEngine())
    for name in in_place.layer_names:
        block = in_place.block(name)
        whole, expected = disk.read(name), converted_disk.read(name)  # read() checks the block's checksum
        fused = [t.name for t in block.tensors if t.expert_stride]
        assert fused and all(torch.equal(whole[n], expected[n]) for n in fused)
        assert expert_read(block.experts.sources, 5, block.experts.stride, direct=True).direct
        if arch == "mixtral":  # w1, w2, w3 side by side: one read through scratch, where it all goes so
            assert len(expert_read(block.experts.sources, 5, block.experts.stride, direct=False).reads) == 1
        start, length = block.experts.extent(5)
        buffer = aligned_empty(block.length)
        disk.wait(disk.submit(name, buffer[start:start + length], start, length))
        assert zlib.crc32(buffer[start:start + length].numpy()) == block.experts.crc32s[5]
        assert all(torch.equal(tensor_views(block, buffer)[n][5], expected[n][5]) for n in fused)
        cut = start + ALIGNMENT  # a layer read in two, cut inside an expert (as GPU staging does)
        halves = aligned_empty(block.length)
        disk.wait_all([disk.submit(name, halves, 0, cut), disk.submit(name, halves[cut:], cut, block.length - cut)])
        assert zlib.crc32(halves.numpy()) == block.crc32


def engine_reads(monkeypatch) -> list[tuple[str, int, int]]:
    """Every read the engine is asked for from now on: (path, offset, bytes)."""
    reads = []
    submit = IoEngine.submit

    def recording(engine, path, dst, file_offset):
        reads.append((str(path), file_offset, dst.numel()))
        return submit(engine, path, dst, file_offset)

    monkeypatch.setattr(IoEngine, "submit", recording)
    return reads


# Mixtral's w1 and w3 joined around w2; gpt_oss's experts fused already, with biases; DeepSeek-V3's
# gate and up joined (the converter Qwen's, OLMoE's and GLM-4.5's share) beside a shared expert,
# after a dense first layer.
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_a_mixture_streams_in_place_per_expert_with_transformers_tokens(make_source, tmp_path, monkeypatch, arch):
    """Depth 1 (no read ahead, no guess): the engine reads each layer's dense pieces and, of its
    experts, exactly those the router picked, each from its own parts of the shards (never a
    layer's experts whole); nothing but the manifest is written. (Each expert's bytes are the
    converted layout's: the test above.)"""
    source = make_source(arch, layers=3)
    expected = reference(source)
    with streamed_in_place(source, tmp_path, prefetch_depth=1) as lm:
        manifest = lm.layout.manifest
        blocks = [manifest.block(name) for name in manifest.layer_names if manifest.block(name).experts]
        assert lm.per_expert == frozenset(b.name for b in blocks) and len(blocks) >= 2

        def expert_reads(block, expert):
            plan = expert_read(block.experts.sources, expert, block.experts.stride, direct=True)
            reads = [(shard, offset, nbytes) for shard, offset, nbytes, _ in plan.direct] + list(plan.reads)
            return [(manifest.shards[shard].path, offset, nbytes) for shard, offset, nbytes in reads]

        planned = {read for block in blocks for expert in range(block.experts.count)
                   for read in expert_reads(block, expert)}
        forwards = record_routing(lm)
        reads = engine_reads(monkeypatch)
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS), expected)
    routed = Counter(read for layers in forwards for block, experts in zip(blocks, layers, strict=True)
                     for expert in experts for read in expert_reads(block, expert))
    assert Counter(read for read in reads if read in planned) == routed
    dense = sum(manifest.block(name).dense_length for name in manifest.layer_names)
    # (a dense part that ends in a shard's last page reads that page through the page cache)
    assert len(forwards) * (dense - ALIGNMENT) <= sum(read[2] for read in reads if read not in planned) <= len(
        forwards) * dense
    written = files_under(tmp_path)
    assert list(written) == [f"{lm.layout.folder.name}/manifest.json"] and sum(written.values()) < 4 << 20


def test_a_fusion_that_is_not_a_placing_of_bytes_converts_with_one_line_saying_why(make_source, tmp_path, capsys,
                                                                                   monkeypatch):
    """A conversion that transposes the joined experts cannot be read in place."""
    mapping = zerolite.convert.in_place.get_model_conversion_mapping

    def transposing(model):
        transforms = [copy.copy(transform) for transform in mapping(model)]
        for transform in transforms:
            if isinstance(transform, WeightConverter):
                transform.operations = [*transform.operations, Transpose(1, 2)]
        return transforms

    monkeypatch.setattr(zerolite.convert.in_place, "get_model_conversion_mapping", transposing)
    source = make_source("qwen2_moe", layers=2)
    with pytest.raises(NotInPlace, match=r"transformers changes model\.layers\.0\.mlp\.experts\.0\..* while loading"):
        plan_in_place(Checkpoint.open(str(source), False), None)
    with zerolite.load(str(source), path=tmp_path, show_progress=False) as lm:
        assert not lm.layout.manifest.in_place
    notes = [line for line in capsys.readouterr().err.splitlines() if "in place" in line]
    assert len(notes) == 1 and "cannot stream in place: transformers changes model.layers.0.mlp.experts" in notes[0]


@pytest.mark.cuda
def test_a_mixture_in_place_on_a_gpu_equals_transformers(make_source, tmp_path, gpu):
    """Each routed expert copied to the device into its place in the slot: its slices, which lie
    in their extents as in their pages of the shards (read there directly, at offsets of 16 to 144
    in 256 here), each copied to a 256-byte offset (test_in_place has every tensor bound there)."""
    source = make_source("mixtral", layers=3, hidden_size=72, intermediate_size=128)  # 36 kB, 9 pages a tensor
    device = reference_device(gpu)
    with streamed_in_place(source, tmp_path, device=gpu) as lm:
        assert lm.per_expert
        addresses = []
        for layer in lm.model.get_submodule(lm.layout.manifest.layers_path):  # after zerolite's hook binds it
            layer.register_forward_pre_hook(lambda module, args: addresses.extend(
                p.data_ptr() for p in module.mlp.experts.parameters()))
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS, device=device).cpu(), reference(source, device))
    assert addresses and not [address % 256 for address in addresses if address % 256]


def test_experts_on_the_cpu_from_a_mixture_in_place_cross_no_link(make_source, tmp_path):
    """`experts` cpu over a checkpoint in place, on the simulated device: the host computes the routed
    experts it read from the shards, the slots take none of their bytes, and the tokens are
    transformers'."""
    source = make_source("deepseek_v3", layers=3)
    sim = SimulatedDevice(seed=7, max_delay_s=2e-4)
    with sim.watching(), streamed_in_place(source, tmp_path, device=sim, experts="cpu", prefetch_depth=2) as lm:
        assert lm.host_experts == lm.per_expert and lm.per_expert
        assert torch.equal(greedy(lm, ROWS, NEW_TOKENS).cpu(), reference(source))
        assert lm.executor.slots.expert_bytes_copied == 0


def test_on_a_device_the_experts_area_moves_after_a_dense_part_that_outgrows_it():
    """A dense part read in place whose tensors, laid out at 256-byte offsets, take more pages
    than they did as read: the experts' area moves after them, every byte carried."""
    dense = [TensorEntry(f"t{n}", "float32", (325,), 8 + n * 1300) for n in range(3)]  # 3900 bytes from 8 on
    experts = [TensorEntry("e.up", "float32", (2, 64), ALIGNMENT, 1024), TensorEntry("e.down", "float32", (2, 32),
                                                                                     ALIGNMENT + 256, 1024)]
    area = ExpertArea("e", ALIGNMENT, 1024, 2, None, (None, None))
    entry = BlockEntry("layers.0", 0, ALIGNMENT + 2048, None, tuple(dense + experts), area)
    placed = device_placement(entry)
    assert placed.entry.experts.offset > ALIGNMENT  # at 0, 1536 and 3072: past the first page
    read = torch.randint(0, 256, (entry.length,), dtype=torch.uint8)
    device = torch.zeros(placed.entry.length, dtype=torch.uint8)
    for move in placed.within(0, entry.length):
        device[move.to:move.to + move.length] = read[move.start:move.start + move.length]
    expected, got = tensor_views(entry, read), tensor_views(placed.entry, device)
    assert all(t.offset % 256 == 0 for t in placed.entry.tensors)
    assert all(torch.equal(expected[name].view(torch.uint8), got[name].view(torch.uint8)) for name in expected)
