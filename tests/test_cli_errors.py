"""Bad input: one line on stderr naming the problem and the fix, a non-zero exit, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from cli_runner import assert_one_line_error, run
from tiny_models import save_tiny_model

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("model") / "src")


@pytest.fixture(scope="module")
def layout(source, tmp_path_factory):
    from zerolite.convert import convert

    path = tmp_path_factory.mktemp("layout") / "layout"
    convert(source, path, show_progress=False)
    return path


def test_missing_model_folder(capsys, monkeypatch, tmp_path):
    result = run(capsys, monkeypatch, "convert", tmp_path / "nowhere", "--path", tmp_path / "out")
    assert_one_line_error(result, "does not exist", "nowhere")


def test_folder_with_no_weights(capsys, monkeypatch, tmp_path, source):
    empty = tmp_path / "config-only"
    empty.mkdir()
    shutil.copy(source / "config.json", empty)
    result = run(capsys, monkeypatch, "convert", empty, "--path", tmp_path / "out")
    assert_one_line_error(result, "no weights in", "model.safetensors")


def test_folder_without_config(capsys, monkeypatch, tmp_path):
    result = run(capsys, monkeypatch, "convert", tmp_path, "--path", tmp_path / "out")
    assert_one_line_error(result, "no config.json")


def test_truncated_safetensors(capsys, monkeypatch, tmp_path, source):
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = run(capsys, monkeypatch, "convert", broken, "--path", tmp_path / "out")
    assert_one_line_error(result, "model.safetensors", "truncated", "download it again")


def test_not_a_causal_lm(capsys, monkeypatch, tmp_path):
    from transformers import T5Config

    folder = tmp_path / "t5"
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(folder)
    save_file({"x": torch.zeros(1)}, folder / "model.safetensors")
    result = run(capsys, monkeypatch, "convert", folder, "--path", tmp_path / "out")
    assert_one_line_error(result, "'t5' is not a causal language model")


def test_path_under_a_regular_file_is_unwritable(capsys, monkeypatch, tmp_path, source):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run(capsys, monkeypatch, "convert", source, "--path", blocker / "layout")
    assert_one_line_error(result, "cannot write to --path", "choose a folder you can write to")


def test_path_on_a_read_only_file_system(capsys, monkeypatch, tmp_path, source):
    result = run(capsys, monkeypatch, "convert", source, "--path", "/proc/zerolite-layout")
    assert_one_line_error(result, "cannot write to --path")


def test_not_enough_free_space_is_found_before_writing(capsys, monkeypatch, tmp_path, source):
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 20))
    result = run(capsys, monkeypatch, "convert", source, "--path", tmp_path / "out")
    assert_one_line_error(result, "not enough free space", "GB is free")
    assert not (tmp_path / "out" / "weights.bin").exists()


def test_unknown_dtype(capsys, monkeypatch, tmp_path, source):
    result = run(capsys, monkeypatch, "convert", source, "--path", tmp_path / "out", "--dtype", "fp8")
    assert_one_line_error(result, "unknown --dtype", "bf16")


def test_missing_option_is_a_usage_error(capsys, monkeypatch):
    result = run(capsys, monkeypatch, "convert")
    assert_one_line_error(result, "Missing option '--path'")
    assert result.code == 2


def test_no_layout_at_path(capsys, monkeypatch, tmp_path):
    assert_one_line_error(run(capsys, monkeypatch, "inspect", tmp_path), "no zerolite layout", "zerolite convert")


def test_truncated_layout(capsys, monkeypatch, tmp_path, layout):
    damaged = tmp_path / "damaged"
    shutil.copytree(layout, damaged)
    data = damaged / "weights.bin"
    os.truncate(data, data.stat().st_size - 4096)
    assert_one_line_error(run(capsys, monkeypatch, "inspect", damaged), "is damaged", "convert the model again")


def test_altered_layout_fails_its_checksum(capsys, monkeypatch, tmp_path, layout):
    damaged = tmp_path / "damaged"
    shutil.copytree(layout, damaged)
    with open(damaged / "weights.bin", "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert run(capsys, monkeypatch, "inspect", damaged).code == 0  # sizes alone look fine
    result = run(capsys, monkeypatch, "inspect", damaged, "--verify")
    assert_one_line_error(result, "fails its checksum", "embed")


def test_altered_manifest(capsys, monkeypatch, tmp_path, layout):
    damaged = tmp_path / "damaged"
    shutil.copytree(layout, damaged)
    manifest = damaged / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"weights.bin"', '"../../etc/passwd"'))
    assert_one_line_error(run(capsys, monkeypatch, "inspect", damaged), "is damaged", "convert the model again")


def test_verify_a_good_layout(capsys, monkeypatch, layout):
    result = run(capsys, monkeypatch, "inspect", layout, "--verify")
    assert result.code == 0 and "every block matches its checksum" in result.stdout


def test_debug_shows_the_traceback(capsys, monkeypatch, tmp_path):
    result = run(capsys, monkeypatch, "--debug", "inspect", tmp_path)
    assert result.code == 1 and "Traceback" in result.stderr and "no zerolite layout" in result.stderr


def test_a_real_process_prints_one_line(tmp_path):
    """The same through the installed console script, as a user runs it."""
    zerolite = shutil.which("zerolite", path=os.path.dirname(sys.executable)) or "zerolite"
    done = subprocess.run([zerolite, "inspect", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("zerolite: error: no zerolite layout")
