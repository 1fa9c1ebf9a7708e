"""tools/bench_moe.py's cheap parts: the DeepSeek-V3-shaped checkpoint tools/models.py writes (the
names, dtypes and shards DeepSeek-V3 publishes, read by transformers, the same bytes every time) and
the routed parts its read pass reads (a converted layout's expert extents, a checkpoint's pieces in place)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from bench_moe import expert_in_place, part_of, routed_parts  # tools/ is on the path: pyproject's pythonpath
from models import write_checkpoint
from zerolite.convert.resolve import in_place
from zerolite.io.engine import IoEngine, align_up, aligned_empty
from zerolite.layout.folder import Layout
from zerolite.layout.store import DiskStore

TINY_DEEPSEEK_V3 = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=128,
                        num_mtp_layers=0)


def stored(folder: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Every tensor of the folder's shards: its dtype, shape and shard."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as shard:
            for name in shard.keys():
                info = shard.get_slice(name)
                found[name] = (info.get_dtype(), tuple(info.get_shape()), path.name)
    return found


def test_the_deepseek_v3_checkpoint_is_written_as_published_and_the_same_every_time(tmp_path):
    """Per-expert tensors under the names save_pretrained gives them, bf16 but the router's weight
    and score correction bias (float32, as transformers keeps them), whole layers in shards of at
    most the size asked (the first holding the embeddings), loaded by transformers with nothing
    missing; written twice, the same bytes."""
    shard_bytes = 200_000
    total = write_checkpoint(tmp_path / "ours", "deepseek_v3", TINY_DEEPSEEK_V3, shard_bytes=shard_bytes,
                             report=lambda line: None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **TINY_DEEPSEEK_V3),
                                     dtype=torch.bfloat16).save_pretrained(tmp_path / "theirs")
    ours, theirs = stored(tmp_path / "ours"), stored(tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in ours
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in ours
    for name, (dtype, shape, _) in ours.items():
        assert shape == theirs[name][1], name
        assert dtype == theirs[name][0] == ("F32" if name.endswith(("e_score_correction_bias", "gate.weight"))
                                            else "BF16"), name
    shards = {}
    for name, (_, _, shard) in ours.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        shards.setdefault(layer, set()).add(shard)
    assert all(len(held) == 1 for held in shards.values()), shards  # each layer whole in one shard
    assert len(set().union(*shards.values())) > 1
    assert shards[None] == shards["0"]
    assert sum(path.stat().st_size for path in (tmp_path / "ours").glob("*.safetensors")) < total + 3 * 20_000
    assert all(path.stat().st_size <= shard_bytes + 20_000 for path in (tmp_path / "ours").glob("*.safetensors"))
    _, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]

    write_checkpoint(tmp_path / "again", "deepseek_v3", TINY_DEEPSEEK_V3, shard_bytes=shard_bytes,
                     report=lambda line: None)
    for path in (tmp_path / "ours").glob("*.safetensors"):
        again = tmp_path / "again" / path.name
        assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(again.read_bytes()).digest()


def read(layout: Layout, name: str, start: int = 0, length: int | None = None) -> bytes:
    disk = DiskStore(layout, IoEngine())
    length = layout.manifest.block(name).length if length is None else length
    buffer = aligned_empty(align_up(length))
    disk.wait(disk.submit(name, buffer, start, length))
    return buffer[:length].numpy().tobytes()


def test_routed_parts_are_a_layers_dense_part_and_its_experts_extents(make_layout):
    """Each part the read pass reads holds the bytes of its stretch of the layer's block; a dense
    layer (DeepSeek-V3's first) is read whole."""
    layout = Layout.open(make_layout("deepseek_v3", layers=3))
    steps = [[[], [1, 6], [0]], [[], [3], [2, 7]]]
    parts, names = routed_parts(layout, steps)
    assert names == ["layers.0", "layers.1.dense", "layers.1.expert1", "layers.1.expert6", "layers.2.dense",
                     "layers.2.expert0", "layers.0", "layers.1.dense", "layers.1.expert3", "layers.2.dense",
                     "layers.2.expert2", "layers.2.expert7"]
    for name in set(names):
        layer, _, what = name.partition(".")[2].partition(".")
        block = layout.manifest.block(f"layers.{layer}")
        start, length = ((0, block.length) if not what else (0, block.dense_length) if what == "dense"
                         else block.experts.extent(int(what.removeprefix("expert"))))
        assert read(parts, name) == read(layout, block.name, start, length), name


@pytest.mark.parametrize("stretch", [(0, 4096), (4096, 8192), (8192, None)])
def test_a_part_of_a_block_in_place_reads_its_stretch_of_the_shards(make_source, tmp_path, stretch):
    """In place a block is pieces of the checkpoint's shards: a part is the stretch of those pieces,
    from the block's start, inside it, or to its end."""
    source = make_source("llama", layers=3, hidden_size=256, intermediate_size=512)
    layout = Layout.open(in_place(str(source), tmp_path / "in-place", None, False))
    block = layout.manifest.block("layers.1")
    assert block.pieces
    start, length = stretch[0], (block.length - stretch[0]) if stretch[1] is None else stretch[1]
    part = part_of(block, "part", start, length, None)
    with_part = Layout(layout.folder, replace(layout.manifest, blocks=(*layout.manifest.blocks, part)))
    assert read(with_part, "part") == read(layout, block.name, start, length)


def test_an_expert_in_place_is_read_by_the_read_pass_as_the_runtime_reads_it(tmp_path):
    """The read pass's part for one expert of a checkpoint in place (the disk's share of the
    step's bound) is the very reads the runtime makes for it: the same pages of the same shards,
    those landing straight in its extent and those through scratch; so the bound prices neither
    more nor less than the step's routed bytes cost."""
    source = tmp_path / "source"
    write_checkpoint(source, "deepseek_v3", TINY_DEEPSEEK_V3)
    layout = Layout.open(in_place(str(source), tmp_path / "in-place", None, False))
    block, shards = layout.manifest.block("layers.1"), layout.manifest.shards
    engine = IoEngine()
    submit, reads = engine.submit, []

    def recorded(path, dst, file_offset=0):
        reads.append((str(path), file_offset, dst.numel()))
        return submit(path, dst, file_offset)

    engine.submit = recorded
    disk = DiskStore(layout, engine)
    for expert in (0, block.experts.count - 1):
        reads.clear()
        start, length = block.experts.extent(expert)
        disk.wait(disk.submit(block.name, aligned_empty(length), start, length))  # as a slot reads it
        part = expert_in_place(block, "part", expert)
        assert sorted(reads) == sorted((shards[p.shard].path, p.offset, p.length) for p in part.pieces)
        assert part.length == sum(n for _, _, n in reads) >= sum(block.experts.sources.lengths)
