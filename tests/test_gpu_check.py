"""tools/gpu_check.py's arguments and its refusal without CUDA, as a person runs it (it needs a GPU to do more)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def gpu_check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # No device visible, even on a CUDA machine: the script must never start its hour of work here.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_names_the_steps_and_the_options():
    done = gpu_check("--help")
    assert done.returncode == 0
    for fragment in ("TORCH_CUDA_SANITIZER=1", "tools/bench.py", "zerolite profile", "--out", "--batch-sizes", "--timeout"):
        assert fragment in done.stdout


def test_refuses_without_cuda_in_one_line_and_writes_no_report(tmp_path):
    done = gpu_check("--out", str(tmp_path / "report.md"), "--batch-sizes", "8", cwd=tmp_path)
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
def test_bad_arguments_are_refused_before_the_cuda_check(args, fragment):
    done = gpu_check(*args)
    assert done.returncode == 2 and fragment in done.stderr and "CUDA" not in done.stderr
