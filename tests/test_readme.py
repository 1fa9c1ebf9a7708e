"""Every command README.md shows runs, on a tiny model standing in for the README's.

The README's shell blocks are read command by command (continuation lines joined, comments
dropped) and each is run for real, in order, in a folder of the test's own: bigscience/bloom is a
tiny BLOOM checkpoint with a one-character-per-token tokenizer and a chat template, /nvme a folder
of the test's, and the server's port 8000 a free one; a generate that names no --max-new-tokens
makes 8 (what a tiny random model makes past them proves nothing more, and its steps read from
disk). A command this test cannot place fails it, so a command added to the README comes with a
way to run it here. Its Python block runs too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.cli_runner import run
from support.tiny_models import CHAT_TEMPLATE, save_ascii_tokenizer
from zerolite.io.device import CpuDevice
from zerolite.planner import measurements
from zerolite.planner.compute_probe import ROWS
from zerolite.planner.hardware import ATTENTION_RECORD

REPOSITORY = Path(__file__).resolve().parents[1]
README = REPOSITORY / "README.md"
MODEL = "bigscience/bloom"
NVME = "/nvme"
PORT = "8000"

# Commands not run here, each with why, and what make would run in the end (checked with make -n).
EXEMPT = {
    "make demo": ("tests/test_generate.py's demo test runs the very zerolite command line `make demo` runs "
                  "(and checks the README shows it); make's own part is the install into .venv",
                  "zerolite generate"),
    "make test": ("it runs this suite, this test among it", "pytest"),
}


def shell_commands(markdown: str) -> list[list[str]]:
    """Each command of the ```sh blocks, as its words: lines ending in a backslash joined to the
    next, comments after # dropped."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if words := shlex.split(line, comments=True):
                commands.append(words)
    return commands


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.M | re.S)


def test_the_readme_shows_commands_of_every_kind_this_test_runs():
    """The reading itself: the blocks are found, and the exemptions are commands the README still shows."""
    commands = [shlex.join(words) for words in shell_commands(README.read_text())]
    assert any(c.startswith("zerolite generate") for c in commands), commands
    assert any(c.startswith("zerolite serve") for c in commands) and any(c.startswith("curl") for c in commands)
    assert set(EXEMPT) <= set(commands), set(EXEMPT) - set(commands)
    assert shell_commands("```sh\na --b 1 \\\n  c   # why\n\n# only a comment\nd 'e f'\n```\n") == \
        [["a", "--b", "1", "c"], ["d", "e f"]]


@pytest.mark.parametrize("command", sorted(EXEMPT))
def test_the_make_targets_the_readme_shows_come_to_their_command(command):
    """make parses the target and ends in the command it exists for (-n: nothing run, nothing installed)."""
    # As a newcomer's shell runs it, not as a make of `make test` (whose MAKELEVEL prints the directory it enters).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run([*shlex.split(command), "-n"], cwd=REPOSITORY, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert EXEMPT[command][1] in done.stdout.strip().splitlines()[-1], done.stdout


@pytest.fixture
def world(tmp_path, monkeypatch, make_source):
    """The README's names made real: a tiny model for bigscience/bloom, a folder for /nvme, and a
    prompts file, in a working folder of the test's own. The machine's figures are recorded
    beforehand, as a profile would have (measuring the disk and probing compute take a minute)."""
    source = make_source("bloom", fresh=True)
    save_ascii_tokenizer(source, CHAT_TEMPLATE)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = "\x00"  # the Python block pads its prompts
    tokenizer.save_pretrained(source)
    (tmp_path / "nvme").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "prompt": "NVMe is"}\n{"id": "b", "prompt": "Disks are"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZEROLITE_CACHE", str(tmp_path / "cache"))
    measurements.record(measurements.file_system(tmp_path), 2.0, "disk_gbps")
    for dtype in (torch.float32, torch.bfloat16):
        rates = {weights: {str(rows): 1e-9 for rows in ROWS} for weights in ("stored", "int8", "int4")}
        measurements.record(measurements.compute_key(CpuDevice(), dtype), rates, "compute")
        measurements.record(measurements.compute_key(CpuDevice(), dtype), 10.0, ATTENTION_RECORD)
    return {MODEL: str(source), NVME: str(tmp_path / "nvme")}


def placed(words: list[str], world: dict[str, str], port: str | None = None) -> list[str]:
    """The command with the README's names replaced by the world's (and the server's port)."""
    out = []
    for word in words:
        if word == MODEL:
            word = world[MODEL]
        elif word == NVME or word.startswith(NVME + "/"):
            word = world[NVME] + word[len(NVME):]
        if port is not None:
            word = word.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")
        out.append(word)
    return out


def start_server(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`zerolite serve ARGS` in a process of its own, on a free port; returns it and its port."""
    server = subprocess.Popen([sys.executable, "-m", "zerolite", *args, "--port", "0"], stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    lines = []
    for line in server.stderr:
        lines.append(line)
        if match := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
            return server, match[1]
    server.kill()
    pytest.fail(f"zerolite serve did not start: {''.join(lines)}")


def check_answer(words: list[str], done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stderr
    if "-N" in words:  # streamed: server-sent events to the end
        events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", done.stdout
        assert all("error" not in json.loads(e) for e in events[:-1]), done.stdout
    else:
        answer = json.loads(done.stdout)
        assert "error" not in answer and answer["choices"], answer


def test_every_readme_command_runs(world, capsys, monkeypatch):
    ran, exempt = [], []
    server = port = None
    try:
        for words in shell_commands(README.read_text()):
            command = shlex.join(words)
            if command in EXEMPT:
                exempt.append(command)
            elif words[:2] == ["zerolite", "serve"]:
                server, port = start_server(placed(words[1:], world))
                ran.append(command)
            elif words[0] == "zerolite":
                unbounded = words[1] == "generate" and "--max-new-tokens" not in words
                shorter = ["--max-new-tokens", "8"] if unbounded else []
                done = run(capsys, monkeypatch, *placed(words[1:], world), *shorter)
                assert done.code == 0, f"{command}\n{done.stderr}"
                if words[1] == "generate" and "--output" not in words:
                    assert done.stdout.strip(), f"{command}: no completion printed"
                ran.append(command)
            elif words[0] == "curl":
                assert server is not None, f"{command}: the README shows no zerolite serve before it"
                curl = shutil.which("curl")
                assert curl is not None, "curl is part of the set-up this test runs in"
                done = subprocess.run([curl, "-sS", "--max-time", "60", *placed(words[1:], world, port)],
                                      capture_output=True, text=True, timeout=90)
                check_answer(words, done)
                ran.append(command)
            else:
                pytest.fail(f"the README shows `{command}`, which this test does not know how to run: teach it")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    assert sorted(exempt) == sorted(EXEMPT)
    assert len(ran) >= 8, ran
    assert Path("out.jsonl").read_text().count("\n") == 2 and json.loads(Path("stats.json").read_text())
    assert json.loads(Path("trace.json").read_text())


def test_the_readme_python_runs(world, capsys):
    from zerolite.convert.writer import convert

    convert(world[MODEL], Path(world[NVME]) / "bloom", show_progress=False)  # as the README's zerolite convert
    for block in python_blocks(README.read_text()):
        exec(compile(block.replace(f'"{NVME}/', f'"{world[NVME]}/'), "README.md", "exec"), {})
    assert capsys.readouterr().out
