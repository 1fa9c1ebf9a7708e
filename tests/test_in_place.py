"""Streaming from the checkpoint's own safetensors shards: the same tokens as transformers, only a
manifest written, the shards' pieces read (several shards, a shard's unaligned end), a changed shard
refused, and one line saying why where a checkpoint converts instead (a mixture's: test_in_place_moe)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerolite
import zerolite.convert.resolve
from support.cli_runner import run
from support.helpers import greedy
from support.simulated_device import SimulatedDevice
from support.tiny_models import save_tiny_model
from test_executor import assert_same_generation, reference_device
from zerolite.errors import ZeroliteError
from zerolite.hf import keep_experts_implementation
from zerolite.io.engine import align_up
from zerolite.layout.folder import Layout, tensor_views
from zerolite.layout.manifest import MANIFEST, BlockEntry, TensorEntry
from zerolite.layout.placement import device_placement

ROWS = [[5, 9, 3, 7, 2, 11], [8, 4, 6]]
NEW_TOKENS = 6
ARCHS = ["llama", "gpt2", "opt", "bloom", "mistral"]


def reference(source: Path, device: str = "cpu"):
    model = AutoModelForCausalLM.from_pretrained(source).eval().to(device)
    return greedy(model, ROWS, NEW_TOKENS, logits=True, device=device)


def aligned_reference(source: Path):
    """transformers' tokens and logits with its weights copied out of safetensors' mmap, where they
    lie unaligned and some CPU kernels round differently (1e-5 on tiny gpt_oss logits), and the
    experts' kernel kept as built (zerolite keeps it)."""
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    keep_experts_implementation(model)
    return greedy(model, ROWS, NEW_TOKENS, logits=True)


def files_under(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_size for path in folder.rglob("*") if path.is_file()}


def streamed_in_place(source: Path, root: Path, device="cpu", **setup):
    """Loads source under root, every layer streamed from disk, and checks that it runs in place."""
    lm = zerolite.load(str(source), path=root, device=device, offload="nvme", cpu_memory=0, gpu_memory=0,
                       show_progress=False, **setup)
    assert lm.layout.manifest.in_place and not (lm.layout.folder / lm.layout.manifest.data_file).exists()
    assert all(name in lm.plan.streamed for name in lm.layout.manifest.layer_names), lm.plan
    return lm


@pytest.mark.parametrize("arch", ARCHS)
def test_in_place_streams_the_shards_and_equals_transformers(make_source, tmp_path, arch):
    source = make_source(arch, layers=3)
    with streamed_in_place(source, tmp_path) as lm:
        assert_same_generation(reference(source), greedy(lm, ROWS, NEW_TOKENS, logits=True))
        layers = sum(lm.layout.manifest.block(name).length for name in lm.layout.manifest.layer_names)
        assert lm.bytes_read >= NEW_TOKENS * layers  # every step read every layer from the shards
    written = files_under(tmp_path)
    assert list(written) == [f"{lm.layout.folder.name}/{MANIFEST}"] and sum(written.values()) < 64 << 10, written


def test_blocks_across_shards_and_a_shards_unaligned_end(tmp_path):
    """Shards of 100 kB: layers straddle shards (a piece in each), and pieces end past a
    shard's last byte (read through the page cache, the rest zeros)."""
    source = tmp_path / "sharded"
    save_tiny_model("llama", source, layers=4, hidden_size=128, intermediate_size=256)
    model = AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(source, max_shard_size="100KB")
    for stale in (source / "model.safetensors",):
        stale.unlink(missing_ok=True)
    with streamed_in_place(source, tmp_path / "root") as lm:
        manifest = lm.layout.manifest
        assert len(manifest.shards) >= 3
        assert any(len({p.shard for p in block.pieces}) >= 2 for block in manifest.blocks), "no block straddles shards"
        assert any(p.offset + p.length > manifest.shards[p.shard].size for b in manifest.blocks for p in b.pieces)
        assert_same_generation(reference(source), greedy(lm, ROWS, NEW_TOKENS, logits=True))


@pytest.mark.cuda
def test_in_place_on_a_gpu_equals_transformers(make_source, tmp_path, gpu):
    source = make_source("llama", layers=3)
    with streamed_in_place(source, tmp_path, device=gpu) as lm:
        device = reference_device(gpu)
        assert_same_generation(reference(source, device), greedy(lm, ROWS, NEW_TOKENS, logits=True, device=device))


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_in_place_on_a_simulated_gpu_binds_every_tensor_at_256_bytes(make_source, tmp_path, arch):
    """safetensors packs tensors one after another from a header of any length, and a width of 72
    (288-byte norms) leaves them at many residues of 256 as read. On a device with memory of its
    own, every tensor is bound at a 256-byte address all the same, streamed (each step's slots) or
    resident (the embeddings and head): an H100's grouped_mm refused gpt_oss's experts in place
    without it. The tokens stay transformers'."""
    source = make_source(arch, layers=3, hidden_size=72)
    sim = SimulatedDevice(seed=3, reports_cuda=True)
    with sim.watching(), streamed_in_place(source, tmp_path, device=sim) as lm:
        manifest = lm.layout.manifest
        residues = {t.offset % 256 for block in manifest.blocks for t in block.tensors}
        assert len(residues) > 2, residues  # as read, the tensors lie at many residues
        addresses = {name: p.data_ptr() for name, p in lm.model.named_parameters() if p.device.type != "meta"}
        assert addresses, "nothing resident to check"
        layers = lm.model.get_submodule(manifest.layers_path)
        for index, layer in enumerate(layers):  # after zerolite's hook, which binds the slot's bytes
            layer.register_forward_pre_hook(lambda module, args, index=index: addresses.update(
                (f"layers.{index}.{name}", p.data_ptr()) for name, p in module.named_parameters()))
        assert_same_generation(aligned_reference(source), greedy(lm, ROWS, NEW_TOKENS, logits=True))
    assert sum(name.startswith("layers.") for name in addresses) == sum(1 for _ in layers.parameters())
    misaligned = {name: address % 256 for name, address in addresses.items() if address % 256}
    assert not misaligned, misaligned


def test_a_placement_carries_every_tensors_bytes_to_an_aligned_place_even_copied_in_pieces():
    """The copies as resident blocks make them, from staging buffers smaller than the block: each
    piece's share of the moves, clipped where a piece ends inside a run of tensors."""
    sizes = [(2, 36), (64,), (128,), (5, 72), (72,), (3,), (7, 9), (1,)]
    tensors, at = [], 8  # from a header of 8 bytes: unaligned from the first tensor on
    for number, shape in enumerate(sizes):
        tensors.append(TensorEntry(f"t{number}", "float32", shape, at))
        at += math.prod(shape) * 4 + (4096 if number == 4 else 0)  # a gap, as between two pieces
    entry = BlockEntry("layers.0", 0, align_up(at), None, tuple(tensors))
    placed = device_placement(entry)
    read = torch.randint(0, 256, (entry.length,), dtype=torch.uint8)
    device = torch.zeros(placed.entry.length, dtype=torch.uint8)
    for start in range(0, entry.length, 1000):
        for move in placed.within(start, min(1000, entry.length - start)):
            device[move.to:move.to + move.length] = read[move.start:move.start + move.length]
    expected, got = tensor_views(entry, read), tensor_views(placed.entry, device)
    assert all(t.offset % 256 == 0 for t in placed.entry.tensors)
    assert all(torch.equal(expected[name].view(torch.uint8), got[name].view(torch.uint8)) for name in expected)
    assert len(placed.moves) < len(sizes)  # tensors that keep their distance move together


def test_a_second_load_reuses_the_manifest_and_a_changed_shard_is_refused(make_source, tmp_path):
    source = make_source("llama", layers=3, fresh=True)
    with streamed_in_place(source, tmp_path) as lm:
        manifest = lm.layout.folder / MANIFEST
    written = manifest.stat().st_mtime_ns
    with streamed_in_place(source, tmp_path):
        assert manifest.stat().st_mtime_ns == written
    shard = source / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))
    with pytest.raises(ZeroliteError,
                       match=r"model.safetensors changed after the layout in place at .* was planned: delete"):
        zerolite.load(str(source), path=tmp_path, show_progress=False)
    with pytest.raises(ZeroliteError, match="changed after"):
        Layout.open(manifest.parent)


@pytest.mark.parametrize("case, why", [
    ("dtype", "is stored as float32, and the run uses bfloat16"),
    ("no O_DIRECT", "refuses O_DIRECT reads"),
    ("int4", "--weights int4 stores its layers' weights as int4"),
])
def test_what_cannot_stream_in_place_converts_with_one_line_saying_why(make_source, tmp_path, capsys, monkeypatch,
                                                                       case, why):
    source = make_source("llama", layers=2)
    if case == "no O_DIRECT":
        monkeypatch.setattr(zerolite.convert.resolve, "supports_direct_io", lambda path: False)
    with zerolite.load(str(source), path=tmp_path, dtype="bf16" if case == "dtype" else None, show_progress=False,
                       weights="int4" if case == "int4" else None) as lm:
        assert not lm.layout.manifest.in_place and lm.layout.data_path.is_file()
        assert (lm.layout.manifest.quantization or {}).get("weights") == ("int4" if case == "int4" else None)
    notes = [line for line in capsys.readouterr().err.splitlines() if "in place" in line]
    assert len(notes) == 1
    assert notes[0].startswith(f"zerolite: converting {source} once, as it cannot stream in place: ")
    assert why in notes[0], notes


def test_verify_records_checksums_that_later_runs_check(make_source, tmp_path, capsys, monkeypatch):
    """Safetensors has no checksums: `zerolite verify` hashes the blocks once into the manifest,
    and a byte altered afterwards (size and time kept, so the shard looks unchanged) is caught."""
    source = make_source("llama", layers=2, fresh=True)
    with streamed_in_place(source, tmp_path) as lm:
        folder = lm.layout.folder
    assert all(block.crc32 is None for block in Layout.open(folder).manifest.blocks)
    done = run(capsys, monkeypatch, "verify", folder)
    assert done.code == 0 and "checksums of" in done.stdout
    assert all(block.crc32 is not None for block in Layout.open(folder).manifest.blocks)
    assert run(capsys, monkeypatch, "verify", folder).stdout.strip() == "every block matches its checksum"
    shard = source / "model.safetensors"
    layer = Layout.open(folder).manifest.block("layers.1")
    stat = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(layer.pieces[0].offset + layer.tensors[0].offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ZeroliteError,
                       match=r"block layers\.\d of the checkpoint in .* fails the checksum `zerolite verify` recorded"):
        with streamed_in_place(source, tmp_path) as lm:
            greedy(lm, ROWS, 2)


def test_a_missing_shard_is_refused_in_one_line_and_inspect_shows_the_pieces(make_source, tmp_path, capsys,
                                                                             monkeypatch):
    source = make_source("llama", layers=2, fresh=True)
    with streamed_in_place(source, tmp_path) as lm:
        folder = lm.layout.folder
    shown = run(capsys, monkeypatch, "inspect", folder)
    assert shown.code == 0 and "read in place from 1 shard(s) of" in shown.stdout and "0:" in shown.stderr
    (source / "model.safetensors").rename(source / "elsewhere.safetensors")
    done = run(capsys, monkeypatch, "inspect", folder)
    assert done.code == 1 and done.stderr.count("\n") == 1
    assert f"model.safetensors, which the layout in place at {folder} reads, is gone" in done.stderr


def test_the_plan_says_the_layers_stream_from_the_checkpoint_in_place(make_source, tmp_path, capsys, monkeypatch):
    source = make_source("llama", layers=2)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 0, "input_ids": [5, 9, 12]}\n')
    done = run(capsys, monkeypatch, "generate", "--model", source, "--path", tmp_path / "nvme", "--device", "cpu",
               "--offload", "nvme", "--cpu-memory", "0", "--input", prompts, "--max-new-tokens", "2")
    assert done.code == 0, done.stderr
    plan = next(line for line in done.stderr.splitlines() if line.startswith("plan: "))
    assert "2 layers streamed from the checkpoint's 1 shard(s), in place" in plan, plan


def test_weights_asked_of_a_layout_in_another_format_are_refused_in_one_line(make_layout, capsys, monkeypatch):
    layout = make_layout("llama", layers=2)
    result = run(capsys, monkeypatch, "generate", "--model", layout, "--weights", "int8", "--device", "cpu", "hi")
    assert result.code != 0 and len(result.stderr.strip().splitlines()) == 1
    assert "holds unquantized weights, not int8" in result.stderr, result.stderr
