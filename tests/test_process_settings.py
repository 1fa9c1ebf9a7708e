"""What zerolite sets for torch on import (zerolite/openmp.py, zerolite/huge_pages.py): set where the
user chose nothing, the user's choice kept, and both left out of what other programs are run with."""

import os
import subprocess
import sys
from pathlib import Path

HUGE_PAGES_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

SHOW = """
import os, zerolite
from zerolite.torch_env import environment_as_the_user_had_it
mine = environment_as_the_user_had_it()
for name in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE"):
    print(name, os.environ.get(name), mine.get(name))
"""

# a 64 MB tensor filled, then the process's anonymous memory on huge pages
HUGE_TENSOR = """
import zerolite, torch
tensor = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")))
"""


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")}
    return subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True,
                          check=True).stdout


def test_set_on_import_and_left_out_for_other_programs():
    shown = run(SHOW).split()
    assert shown == ["OMP_WAIT_POLICY", "PASSIVE", "None", "THP_MEM_ALLOC_ENABLE", "1", "None"]


def test_the_users_choice_is_kept():
    shown = run(SHOW, OMP_WAIT_POLICY="ACTIVE", THP_MEM_ALLOC_ENABLE="0").split()
    assert shown == ["OMP_WAIT_POLICY", "ACTIVE", "ACTIVE", "THP_MEM_ALLOC_ENABLE", "0", "0"]


def test_large_tensors_land_on_huge_pages_where_the_machine_allows_them():
    mode = HUGE_PAGES_MODE.read_text() if HUGE_PAGES_MODE.exists() else "[never]"
    huge_kb = int(run(HUGE_TENSOR))
    if "[never]" in mode:
        assert huge_kb == 0
    elif "[madvise]" in mode:  # only where asked: what zerolite sets makes the difference
        assert huge_kb >= 32 << 10
        assert int(run(HUGE_TENSOR, THP_MEM_ALLOC_ENABLE="0")) == 0
    else:
        assert huge_kb >= 32 << 10
