"""tools/gpu_check.py's arguments and its refusal without CUDA (it needs a GPU to do more): the refusal
as a person meets it, in a process of its own; --help and the arguments' checks in this process (a
fresh interpreter would prove nothing more about them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli_runner import run_tool

ROOT = Path(__file__).resolve().parent.parent


def test_help_names_the_steps_and_the_options(capsys, monkeypatch):
    done = run_tool(capsys, monkeypatch, "gpu_check", "--help")
    assert done.code == 0
    for fragment in ("TORCH_CUDA_SANITIZER=1", "tools/bench.py", "zerolite profile", "--out", "--batch-sizes",
                     "--timeout"):
        assert fragment in done.stdout


def test_refuses_without_cuda_in_one_line_and_writes_no_report(tmp_path):
    # No device visible, even on a CUDA machine: the script must never start its hour of work here.
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path / "report.md"),
                           "--batch-sizes", "8"], cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_check: error: no CUDA device")
    assert not (tmp_path / "report.md").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--batch-sizes", "32,x"], "'x' is not a whole number from 1 to 4096"),
    (["--batch-sizes", "0"], "'0' is not a whole number from 1 to 4096"),
    (["--new-tokens", "1"], "'1' is not a whole number from 2 to 4096"),
    (["--timeout", "5"], "'5' is not a whole number from 60 to 86400"),
    (["--contenders", "zerolite-nvme,vllm"], "unknown contender 'vllm'"),
    (["--out", "nowhere/report.md"], "folder"),
    (["--device", "cpu"], "unrecognized arguments: --device"),
])
def test_bad_arguments_are_refused_before_the_cuda_check(capsys, monkeypatch, args, fragment):
    done = run_tool(capsys, monkeypatch, "gpu_check", *args)
    assert done.code == 2 and fragment in done.stderr and "CUDA" not in done.stderr
