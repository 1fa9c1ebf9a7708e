"""Bad input that needs more than a command line (damaged files, a full disk), and how errors show:
the exit code of a usage error, the traceback under --debug, the one line from a real process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from support.cli_runner import assert_one_line_error, run


def test_truncated_safetensors(capsys, monkeypatch, tmp_path, make_source):
    broken = make_source(fresh=True)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = run(capsys, monkeypatch, "convert", broken, "--path", tmp_path / "out")
    assert_one_line_error(result, "model.safetensors", "truncated", "download it again")


def test_not_enough_free_space_is_found_before_writing(capsys, monkeypatch, tmp_path, make_source):
    source = make_source()
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 20))
    result = run(capsys, monkeypatch, "convert", source, "--path", tmp_path / "out")
    assert_one_line_error(result, "not enough free space", "GB is free")
    assert not (tmp_path / "out" / "weights.bin").exists()


def test_a_missing_option_is_a_usage_error(capsys, monkeypatch):
    assert run(capsys, monkeypatch, "convert").code == 2


def test_truncated_layout(capsys, monkeypatch, make_layout):
    damaged = make_layout(fresh=True)
    data = damaged / "weights.bin"
    os.truncate(data, data.stat().st_size - 4096)
    assert_one_line_error(run(capsys, monkeypatch, "inspect", damaged), "is damaged", "convert the model again")


def test_altered_layout_fails_its_checksum(capsys, monkeypatch, make_layout):
    damaged = make_layout(fresh=True)
    with open(damaged / "weights.bin", "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert run(capsys, monkeypatch, "inspect", damaged).code == 0  # sizes alone look fine
    result = run(capsys, monkeypatch, "inspect", damaged, "--verify")
    assert_one_line_error(result, "fails its checksum", "embed")


def test_altered_manifest(capsys, monkeypatch, make_layout):
    damaged = make_layout(fresh=True)
    manifest = damaged / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"weights.bin"', '"../../etc/passwd"'))
    assert_one_line_error(run(capsys, monkeypatch, "inspect", damaged), "is damaged", "convert the model again")


def test_verify_a_good_layout(capsys, monkeypatch, make_layout):
    result = run(capsys, monkeypatch, "inspect", make_layout(), "--verify")
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
