"""Nothing lost: outputs survive SIGKILL and resume, one writer at a time, I/O faults end cleanly."""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support.cli_runner import assert_one_line_error, run
from support.helpers import generate_args, lines_by_id
from zerolite.cli import main as cli
from zerolite.io.engine import FAULT_VARIABLE

LAYERS = 6
PROMPTS = 24
BATCH = 3
NEW_TOKENS = 12
ZEROLITE = shutil.which("zerolite", path=os.path.dirname(sys.executable)) or "zerolite"


@pytest.fixture(scope="module")
def layout(make_layout):
    return make_layout(layers=LAYERS)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"q{i}", "input_ids": [rng.randrange(3, 128) for _ in range(rng.randrange(2, 9))]}) + "\n"
        for i in range(PROMPTS)
    ))
    return path


def streamed(layout, prompts, output) -> list[str]:
    """generate's arguments here: every layer streamed from disk."""
    return generate_args(layout, prompts, output, "--cpu-memory", "0", batch=BATCH, new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(layout, prompts, tmp_path_factory) -> bytes:
    """What a run that is never killed writes, run once in this process for the tests that crash runs."""
    output = tmp_path_factory.mktemp("reference") / "out.jsonl"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        patch.setattr(sys, "argv", ["zerolite", *map(str, streamed(layout, prompts, output))])
        cli.main()
    assert exit_info.value.code == 0
    return output.read_bytes()


def lines_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_at_random_moments_then_rerun_loses_and_repeats_nothing(capsys, monkeypatch, tmp_path, layout, prompts,
                                                                       reference):
    """The runs killed are processes of their own: the first at a random moment inside start-up, each
    other once the output has grown by a random few lines (among the batches, at times in the middle
    of a write). The reference and the rerun run in this one."""
    (tmp_path / "reference.jsonl").write_bytes(reference)
    expected = lines_by_id(tmp_path / "reference.jsonl", parsed=True)
    assert len(expected) == PROMPTS

    output = tmp_path / "out.jsonl"
    rng = random.Random(7)
    kills = 0
    for run_number in range(3):
        before = lines_in(output)
        process = subprocess.Popen([ZEROLITE, *streamed(layout, prompts, output)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        if run_number == 0:
            time.sleep(rng.uniform(0.2, 1.5))
        else:
            grown = rng.randint(1, BATCH + 1)
            while process.poll() is None and lines_in(output) < before + grown:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
        assert lines_in(output) <= PROMPTS
    assert run(capsys, monkeypatch, *streamed(layout, prompts, output)).code == 0
    assert kills >= 3, "the runs finished before they could be killed: the test proves nothing"
    assert lines_by_id(output, parsed=True) == expected
    assert output.read_text().endswith("\n")


def test_a_torn_last_line_is_redone(capsys, monkeypatch, tmp_path, layout, prompts, reference):
    output = tmp_path / "out.jsonl"
    output.write_bytes(reference[: len(reference) - 40])  # a crash in the middle of the last write
    assert run(capsys, monkeypatch, *streamed(layout, prompts, output)).code == 0
    assert output.read_bytes() == reference


def test_a_second_writer_of_the_same_output_is_refused(capsys, monkeypatch, tmp_path, layout, prompts):
    output = tmp_path / "out.jsonl"
    with open(output, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running zerolite holds it
        result = run(capsys, monkeypatch, *streamed(layout, prompts, output))
    assert_one_line_error(result, "another zerolite is writing --output")
    assert output.read_bytes() == b""


def test_an_output_that_is_some_other_file_is_left_alone(capsys, monkeypatch, tmp_path, layout, prompts):
    output = tmp_path / "notes.txt"
    output.write_text("my notes\n")
    result = run(capsys, monkeypatch, *streamed(layout, prompts, output))
    assert_one_line_error(result, "is not a zerolite completion", "choose another --output")
    assert output.read_text() == "my notes\n"


@pytest.mark.parametrize(("fault", "cause"), [("eio@3", "Input/output error"), ("short@3", "short read"),
                                               ("eio@150", "Input/output error"), ("short@150", "short read")])
def test_io_faults_inside_the_engine_end_in_one_clear_line(capsys, monkeypatch, tmp_path, layout, prompts, fault,
                                                           cause):
    """@3: while loading the resident blocks; @150: while streaming layers, a batch or two written.
    (The engine reads the fault when it starts, so this process will do.)"""
    monkeypatch.setenv(FAULT_VARIABLE, fault)
    output = tmp_path / "out.jsonl"
    done = run(capsys, monkeypatch, *streamed(layout, prompts, output))
    assert done.code == 1
    # The plan may come first when the fault strikes after loading; the error is one line, the last.
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerolite: error:")]
    assert len(errors) == 1 and done.stderr.splitlines()[-1] == errors[0], done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert cause in errors[0] and "weights.bin" in errors[0] and "convert the model again" in errors[0]
    written = output.read_text().splitlines()
    assert fault.endswith("@3") or written, "the fault struck before a batch was written: nothing to check"
    for line in written:  # whatever was written is whole
        json.loads(line)


def test_a_file_system_filling_up_during_convert(capsys, monkeypatch, tmp_path, make_source):
    """A size-limited tmpfs that the free-space estimate wrongly passes (as on a disk another
    program is filling): allocating the data file hits ENOSPC; the error is clear, no manifest is
    written, and once there is room the convert completes."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        source = make_source(layers=LAYERS)
        with monkeypatch.context() as patch:
            real_usage = shutil.disk_usage
            patch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 40))
            result = run(capsys, monkeypatch, "convert", source, "--path", mount / "layout")
        assert_one_line_error(result, "ran out of space")
        assert not (mount / "layout" / "manifest.json").exists()
        subprocess.run(["mount", "-o", "remount,size=128m", str(mount)], check=True)
        assert run(capsys, monkeypatch, "convert", source, "--path", mount / "layout").code == 0
        assert (mount / "layout" / "manifest.json").exists()
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("block", ["embed", "layers.4"])
def test_a_layout_altered_after_convert_is_caught_before_its_bytes_are_used(capsys, monkeypatch, tmp_path, make_layout,
                                                                           prompts, block):
    """Resident blocks are checked as they load, streamed ones the first time they are read."""
    from zerolite.layout.folder import Layout

    altered = make_layout(layers=LAYERS, fresh=True)
    offset = Layout.open(altered).manifest.block(block).offset + 100
    with open(altered / "weights.bin", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    result = run(capsys, monkeypatch, *streamed(altered, prompts, tmp_path / "out.jsonl"))
    assert_one_line_error(result, f"block {block}", "fails its checksum", "weights.bin", "convert the model again",
                          after_plan=True)


def test_a_layout_truncated_after_convert(capsys, monkeypatch, make_layout):
    truncated = make_layout(layers=LAYERS, fresh=True)
    os.truncate(truncated / "weights.bin", (truncated / "weights.bin").stat().st_size // 2)
    result = run(capsys, monkeypatch, "generate", "hi", "--model", truncated, "--device", "cpu")
    assert_one_line_error(result, "is damaged", "weights.bin", "convert the model again")


def test_a_second_convert_into_the_same_layout_is_refused(capsys, monkeypatch, tmp_path, make_source):
    target = tmp_path / "layout"
    target.mkdir()
    with open(target / ".zerolite.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running convert holds it
        result = run(capsys, monkeypatch, "convert", make_source(layers=LAYERS), "--path", target)
    assert_one_line_error(result, "another zerolite is converting into", "choose another --path")
    assert not (target / "weights.bin").exists()
