"""A converted layout, read back block by block, is bit-identical to its checkpoint."""

from __future__ import annotations

import json
import threading
import time

import gguf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import zerolite
import zerolite.convert.writer as convert_module
from bench_gguf import gguf_folder, make_gguf
from support.cli_runner import assert_one_line_error, run
from support.helpers import greedy
from support.tiny_models import build_tiny_model, save_tiny_model
from zerolite.convert.gguf import gguf_as_folder
from zerolite.convert.read_ahead import read_ahead
from zerolite.convert.writer import JOURNAL, convert
from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT, IoEngine
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import MANIFEST, Manifest
from zerolite.layout.store import DiskStore

ARCHS = ["llama", "bloom", "opt", "gpt2"]


def safetensors_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            tensors.update((k, f.get_tensor(k)) for k in f.keys())
    return tensors


def read_all(layout: Layout) -> dict[str, torch.Tensor]:
    disk = DiskStore(layout, IoEngine())
    tensors = {}
    for block in layout.blocks:
        tensors.update(disk.read(block.name))
    return tensors


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
def test_layout_is_bit_identical_to_safetensors_source(make_source, make_layout, arch, tie):
    folder = make_layout(arch, tie=tie)
    layout = Layout.open(folder)
    manifest = layout.manifest
    stored = read_all(layout)
    expected = safetensors_tensors(make_source(arch, tie=tie))

    assert set(stored) == set(expected)  # tied weights: stored once, as in the checkpoint
    for name, tensor in expected.items():
        assert stored[name].dtype == tensor.dtype and stored[name].shape == tensor.shape
        assert torch.equal(stored[name].view(torch.uint8), tensor.view(torch.uint8)), name
    if tie:
        assert len(manifest.aliases) == 1
        (alias, target), = manifest.aliases.items()
        assert alias.endswith("lm_head.weight") and target in stored
    else:
        assert manifest.aliases == {}
    # Blocks: embed, one per layer, head; each extent 4 KiB aligned and in execution order.
    names = [b.name for b in manifest.blocks]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert all(b.offset % ALIGNMENT == 0 and b.length % ALIGNMENT == 0 for b in manifest.blocks)
    assert (folder / "config.json").is_file()
    assert not (folder / JOURNAL).exists()


def test_names_come_out_as_the_module_names_for_a_legacy_checkpoint(tmp_path, make_source):
    """BLOOM's original checkpoints lack the `transformer.` prefix; transformers maps them on load,
    and the layout must hold what the module has, not what the file says."""
    source = make_source("bloom", fresh=True)
    legacy = {k.removeprefix("transformer."): v for k, v in safetensors_tensors(source).items()}
    (source / "model.safetensors").unlink()
    save_file(legacy, source / "model.safetensors", metadata={"format": "pt"})

    convert(source, tmp_path / "layout", show_progress=False)
    stored = read_all(Layout.open(tmp_path / "layout"))
    reference = AutoModelForCausalLM.from_pretrained(source).state_dict()
    assert set(stored) == {"transformer." + k for k in legacy}
    for name, tensor in stored.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_conversion_matches_a_plain_cast(make_source, make_layout, dtype, torch_dtype):
    stored = read_all(Layout.open(make_layout(dtype=dtype)))
    for name, tensor in safetensors_tensors(make_source()).items():
        assert torch.equal(stored[name], tensor.to(torch_dtype)), name


def test_a_gguf_converts_to_what_transformers_reads_from_it_and_generates_its_tokens(make_source, tmp_path,
                                                                                    monkeypatch):
    """The GGUF is read once for the config, the weights and the tokenizer (gguf-py patched for
    the while: put back afterwards); its weights, tokenizer and greedy tokens are transformers' own."""
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    source = make_source("llama", tie=False)  # grouped-query k: its rows' permutation undone as transformers does
    path = make_gguf(source, gguf_folder(source, tmp_path), "bf16")
    make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    folder = gguf_as_folder(path)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (make_reader, make_name_map)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    ours = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert ours.keys() == theirs.state_dict().keys()
    assert all(torch.equal(ours[name], weight) for name, weight in theirs.state_dict().items())
    their_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == their_tokenizer.get_vocab()
    prompt = torch.tensor([[1, 5, 17, 33, 9, 44]])
    with zerolite.load(path, path=tmp_path / "layout", device="cpu", show_progress=False) as lm:
        assert torch.equal(greedy(lm, prompt, 6, exact=True), greedy(theirs, prompt, 6, exact=True))


def test_sharded_checkpoint(tmp_path):
    build_tiny_model("llama").save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "src", tmp_path / "layout", show_progress=False)
    stored = read_all(Layout.open(tmp_path / "layout"))
    for name, tensor in safetensors_tensors(tmp_path / "src").items():
        assert torch.equal(stored[name], tensor), name


def test_pickled_weights_only_with_allow_pickle(tmp_path):
    model = build_tiny_model("gpt2")
    (tmp_path / "src").mkdir()
    model.config.save_pretrained(tmp_path / "src")
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(ZeroliteError, match="`allow_pickle`"):
        convert(tmp_path / "src", tmp_path / "layout", show_progress=False)
    convert(tmp_path / "src", tmp_path / "layout", allow_pickle=True, show_progress=False)
    stored = read_all(Layout.open(tmp_path / "layout"))
    for name, tensor in stored.items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_interrupted_conversion_resumes_without_rewriting_finished_blocks(tmp_path, monkeypatch, make_source):
    source = make_source()
    real_write_block = convert_module.write_block
    written = []

    def write_then_crash(fd, planned, tensors, out):
        if len(written) == 2:
            raise KeyboardInterrupt  # the process dies after two durable blocks
        written.append(planned.name)
        return real_write_block(fd, planned, tensors, out)

    monkeypatch.setattr(convert_module, "write_block", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        convert(source, tmp_path / "layout", show_progress=False)
    assert not (tmp_path / "layout" / MANIFEST).exists()
    with pytest.raises(ZeroliteError, match="did not finish"):
        Layout.open(tmp_path / "layout")

    monkeypatch.setattr(convert_module, "write_block", lambda *a: written.append(a[1].name) or real_write_block(*a))
    convert(source, tmp_path / "layout", show_progress=False)
    assert written == ["embed", "layers.0", "layers.1", "layers.2", "head"]  # nothing written twice
    stored = read_all(Layout.open(tmp_path / "layout"))
    for name, tensor in safetensors_tensors(source).items():
        assert torch.equal(stored[name], tensor), name


def test_converting_again_reuses_a_finished_layout_and_redoes_a_changed_one(tmp_path, make_source):
    source = make_source("gpt2", fresh=True)
    first = convert(source, tmp_path / "layout", show_progress=False)
    before = (tmp_path / "layout" / "weights.bin").stat().st_mtime_ns
    assert convert(source, tmp_path / "layout", show_progress=False) == first
    assert (tmp_path / "layout" / "weights.bin").stat().st_mtime_ns == before

    save_tiny_model("gpt2", source, seed=1)  # new weights, same name
    second = convert(source, tmp_path / "layout", show_progress=False)
    assert second.source["fingerprint"] != first.source["fingerprint"]
    stored = read_all(Layout.open(tmp_path / "layout"))
    for name, tensor in safetensors_tensors(source).items():
        assert torch.equal(stored[name], tensor), name


def test_manifest_lists_every_tensor_with_dtype_shape_and_offset(make_layout):
    raw = json.loads((make_layout("opt") / MANIFEST).read_text())
    assert raw["format"] == "zerolite-layout" and raw["model_type"] == "opt"
    block = raw["blocks"][1]
    assert {"name", "offset", "length", "crc32", "tensors"} <= set(block)
    assert {"name", "dtype", "shape", "offset"} <= set(block["tensors"][0])


def test_blocks_are_found_by_name_and_a_repeated_name_is_refused(tmp_path):
    manifest = convert(save_tiny_model("llama", tmp_path / "src"), tmp_path / "layout", show_progress=False)
    assert [manifest.block(b.name) for b in manifest.blocks] == list(manifest.blocks)
    with pytest.raises(KeyError, match="no block named 'layers.9'"):
        manifest.block("layers.9")
    raw = json.loads(manifest.to_json())
    raw["blocks"][2]["name"] = "layers.0"
    with pytest.raises(ZeroliteError, match="two blocks share a name"):
        Manifest.from_json(json.dumps(raw), tmp_path / MANIFEST)


def test_only_the_config_and_tokenizer_files_come_along_from_the_model_folder(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")
    (source / "tokenizer_config.json").write_text("{}")
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (source / "prompts.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')  # the user's own files
    (source / "reference.json").write_text("{}")
    (source / "modeling_custom.py").write_text("")
    convert(source, tmp_path / "layout", show_progress=False)
    copied = {str(path.relative_to(tmp_path / "layout")) for path in (tmp_path / "layout").rglob("*") if path.is_file()}
    assert copied == {MANIFEST, "weights.bin", ".zerolite.lock", "config.json", "generation_config.json",
                      "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/tool_use.jinja"}


def test_convert_refuses_a_folder_holding_other_files(capsys, monkeypatch, tmp_path):
    source = save_tiny_model("gpt2", tmp_path / "src")
    disk = tmp_path / "nvme"
    disk.mkdir()
    (disk / "notes.txt").write_text("mine")
    result = run(capsys, monkeypatch, "convert", source, "--path", disk)
    assert_one_line_error(result, f"--path {disk} holds other files and no zerolite layout",
                          "convert into a new or empty folder, such as " + str(disk / "src-"))
    assert [path.name for path in disk.iterdir()] == ["notes.txt"]  # nothing written beside them


def test_the_next_block_is_read_while_this_one_is_written(tmp_path, monkeypatch, make_source):
    """Convert reads ahead: block i + 1 is taken out of the checkpoint, on another thread, before
    block i's write returns (converting a 26 GB model to int4 was a read, a quantizing and a write
    in a row)."""
    real_iter, real_write_block = convert_module.iter_block_tensors, convert_module.write_block
    events = []

    def reading(*args, **kwargs):
        for block, tensors in real_iter(*args, **kwargs):
            events.append(("read", block.name, threading.current_thread()))
            yield block, tensors

    def writing(fd, planned, tensors, out):
        read_next = len([e for e in events if e[0] == "read"]) + 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len([e for e in events if e[0] == "read"]) < min(read_next, 5):
            time.sleep(0.01)  # the reader fills in the next block meanwhile, or never does
        events.append(("write", planned.name, threading.current_thread()))
        return real_write_block(fd, planned, tensors, out)

    monkeypatch.setattr(convert_module, "iter_block_tensors", reading)
    monkeypatch.setattr(convert_module, "write_block", writing)
    convert(make_source(), tmp_path / "layout", show_progress=False)
    order = [(kind, name) for kind, name, _ in events]
    assert order[:4] == [("read", "embed"), ("read", "layers.0"), ("write", "embed"), ("read", "layers.1")]
    assert {thread for kind, _, thread in events if kind == "read"}.isdisjoint(
        {thread for kind, _, thread in events if kind == "write"})


def test_read_ahead_runs_at_most_depth_items_ahead_and_hands_errors_on():
    produced = []

    def source():
        for i in range(6):
            produced.append(i)
            if i == 4:
                raise ValueError("shard 4 is damaged")
            yield i

    taken = []
    with pytest.raises(ValueError, match="shard 4"):
        for item in read_ahead(source(), depth=1):
            time.sleep(0.05)  # the reader has all the time it wants to run further ahead
            assert len(produced) <= item + 2  # the item in hand, the one read ahead
            taken.append(item)
    assert taken == [0, 1, 2, 3]


def test_read_ahead_stops_its_reader_when_the_caller_stops():
    closed = threading.Event()

    def source():
        try:
            yield from range(100)
        finally:
            closed.set()

    for item in read_ahead(source()):
        if item == 2:
            break
    assert closed.is_set()
    assert not [t for t in threading.enumerate() if t.name == "zerolite-read-ahead"]
