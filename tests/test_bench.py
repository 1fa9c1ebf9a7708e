"""tools/bench.py's cheap parts: its arguments, --memory-limit's sizes, which cgroup hierarchy it
picks (on a fake sysfs), the read-only pass its disk bound comes from, and the GGUF file its
llama.cpp contenders run (read back by transformers; llama.cpp itself is not installed by the tests)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import agreement, build_parser  # tools/ is on the path: pyproject's pythonpath
from bench_cgroup import MemoryCgroup, hierarchy, parse_limit
from bench_gguf import gguf_folder, make_gguf
from support.tiny_models import VOCAB
from zerolite.errors import ZeroliteError
from zerolite.layout.folder import Layout
from zerolite.layout.read_pass import read_pass

REQUIRED = ["--source", "s", "--layout", "l"]


def test_arguments_repeat_and_memory_limit():
    args = build_parser().parse_args(REQUIRED + ["--repeat", "5", "--memory-limit", "1.5GB"])
    assert args.repeat == 5 and args.memory_limit == 1_500_000_000
    defaults = build_parser().parse_args(REQUIRED)
    assert defaults.repeat == 1 and defaults.memory_limit is None


@pytest.mark.parametrize("bad", [["--repeat", "0"], ["--repeat", "two"], ["--memory-limit", "1.5"],
                                 ["--memory-limit", "0"], ["--memory-limit", "lots"]])
def test_bad_arguments_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(REQUIRED + bad)
    assert bad[0] in capsys.readouterr().err


def test_memory_limit_sizes():
    assert parse_limit("1536MiB") == 1536 << 20
    assert parse_limit("2GB") == 2 * 10**9
    with pytest.raises(ZeroliteError, match="no memory to run in"):
        parse_limit("0")


def fake_sysfs(root: Path, v2_controllers: str | None = None, unified: str | None = None, v1: bool = False) -> Path:
    if v2_controllers is not None:
        (root / "cgroup.controllers").write_text(v2_controllers)
        (root / "cgroup.subtree_control").write_text("")
    if unified is not None:
        (root / "unified").mkdir()
        (root / "unified" / "cgroup.controllers").write_text(unified)
    if v1:
        (root / "memory").mkdir()
        (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return root


def test_hierarchy_prefers_v2_with_memory_then_v1(tmp_path):
    (tmp_path / "v2").mkdir(), (tmp_path / "hybrid").mkdir(), (tmp_path / "v1").mkdir(), (tmp_path / "none").mkdir()
    assert hierarchy(fake_sysfs(tmp_path / "v2", v2_controllers="cpu io memory pids")) == (2, tmp_path / "v2")
    # The machines' layout: v2 mounted beside v1 with only hugetlb in it; memory is v1's.
    hybrid = fake_sysfs(tmp_path / "hybrid", unified="hugetlb", v1=True)
    assert hierarchy(hybrid) == (1, hybrid / "memory")
    assert hierarchy(fake_sysfs(tmp_path / "v1", v2_controllers="cpu", v1=True)) == (1, tmp_path / "v1" / "memory")
    with pytest.raises(ZeroliteError, match="no writable memory cgroup"):
        hierarchy(tmp_path / "none")


def test_v2_cgroup_is_made_limited_and_entered(tmp_path):
    root = fake_sysfs(tmp_path, v2_controllers="memory")
    cgroup = MemoryCgroup.create("zerolite-nvme", 1_500_000_000, root=root)
    assert cgroup.path == root / "zerolite-bench-zerolite-nvme"
    assert (cgroup.path / "memory.max").read_text() == "1500000000\n"
    assert "memory" in (root / "cgroup.subtree_control").read_text()
    command = cgroup.wrap(["python", "x.py"])
    assert command[:2] == ["sh", "-c"] and command[3] == str(cgroup.path / "cgroup.procs")
    assert command[-2:] == ["python", "x.py"]
    (cgroup.path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroup.oom_kills() == 1


def test_v1_cgroup_limits_memory_and_swap(tmp_path):
    root = fake_sysfs(tmp_path, v1=True)
    parent = root / "memory"
    cgroup = MemoryCgroup.create("deepspeed-nvme", 10**9, root=root)
    assert cgroup.version == 1 and cgroup.path.parent == parent
    assert (cgroup.path / "memory.limit_in_bytes").read_text() == "1000000000\n"
    assert not (cgroup.path / "memory.memsw.limit_in_bytes").exists()  # no swap accounting here: skipped, not made
    (cgroup.path / "memory.limit_in_bytes").unlink()
    cgroup.remove()
    assert not cgroup.path.exists()


def test_read_pass_reads_the_layers_once_per_pass(make_layout):
    layout = Layout.open(make_layout("llama", layers=3))
    names = list(layout.manifest.layer_names)
    figures = read_pass(layout, names, passes=4, depth=2)
    assert figures["bytes_per_pass"] == layout.manifest.nbytes(names)
    assert len(figures["pass_s"]) == 4 and all(s > 0 for s in figures["pass_s"])
    assert figures["read_gbps"] > 0
    with pytest.raises(ZeroliteError, match="no block is streamed"):
        read_pass(layout, [], passes=1)


def test_bf16_gguf_holds_the_source_weights(make_source, tmp_path):
    """transformers reads a GGUF Llama undoing the q/k row permutation llama.cpp's converter applies:
    read back, every weight is the source's in bf16 (norms in f32), grouped-query k included."""
    source = make_source("llama", tie=False, fresh=True)  # 4 heads, 2 of them for k and v; its own lm_head
    folder = gguf_folder(source, tmp_path)
    path = make_gguf(source, folder, "bf16")
    written = path.stat().st_mtime_ns
    assert make_gguf(source, folder, "bf16") == path and path.stat().st_mtime_ns == written  # kept, not made again
    assert len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data) == VOCAB
    read_back = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).state_dict()
    weights = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    assert read_back.keys() == weights.keys()
    for name, weight in weights.items():
        expected = weight.to(torch.bfloat16).float() if weight.dim() > 1 else weight
        assert torch.equal(read_back[name], expected), name
    with pytest.raises(ZeroliteError, match="no GGUF of 'q5_k' weights"):
        make_gguf(source, folder, "q5_k")
    os.utime(source / "model.safetensors", ns=(written, written))  # the source saved again
    assert gguf_folder(source, tmp_path) != folder


def test_agreement_counts_tokens_up_to_each_rows_first_difference():
    reference = [[5, 6, 7, 8], [5, 6, 7, 8]]
    assert agreement(reference, reference) == 1.0
    assert agreement([[5, 6, 0, 8], [0, 6, 7, 8]], reference) == 2 / 8  # the 8 after a difference is not counted
