"""A memory cgroup for one contender of tools/bench.py, so that a model larger than the limit meets
the disk the way it does when it really does not fit in RAM (page-cache contenders above all).

    cgroup = MemoryCgroup.create("zerolite-nvme", limit_bytes=1_500_000_000)   # root only
    subprocess.run(cgroup.wrap(command))     # the child enters the cgroup before it loads anything
    cgroup.oom_kills(); cgroup.remove()

cgroup v2 where the unified hierarchy is mounted with the memory controller and writable, else the
v1 memory controller. Swap is limited too (where the files exist), so that the limit is one of RAM.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from zerolite.errors import ZeroliteError
from zerolite.runtime.policy import parse_size

SYSFS = Path("/sys/fs/cgroup")
PREFIX = "zerolite-bench-"
# The child writes its own pid into cgroup.procs, then becomes the contender: everything it
# allocates from its first byte on is charged to the cgroup.
ENTER = 'echo $$ > "$0" && exec "$@"'


def parse_limit(text: str) -> int:
    """--memory-limit: a size with a unit (1.5GB, 1536MiB), more than nothing."""
    size = parse_size(text, "--memory-limit")
    if size <= 0:
        raise ZeroliteError(f"--memory-limit {text!r} leaves no memory to run in: give a size such as 1.5GB")
    return size


def hierarchy(root: Path = SYSFS) -> tuple[int, Path]:
    """(version, folder new cgroups go in): v2 where its memory controller is available and the
    folder writable, else v1's memory controller."""
    for folder in (root, root / "unified"):  # pure v2, or v2 beside v1 ("hybrid")
        controllers = folder / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split() and os.access(folder, os.W_OK):
            return 2, folder
    v1 = root / "memory"
    if (v1 / "memory.limit_in_bytes").is_file() and os.access(v1, os.W_OK):
        return 1, v1
    raise ZeroliteError(f"no writable memory cgroup under {root} (neither v2 with the memory controller nor v1's "
                        "memory controller): run as root, or leave out --memory-limit")


@dataclass
class MemoryCgroup:
    version: int
    path: Path

    @classmethod
    def create(cls, contender: str, limit_bytes: int, root: Path = SYSFS) -> MemoryCgroup:
        version, parent = hierarchy(root)
        path = parent / f"{PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', contender)}"
        if path.is_dir():
            path.rmdir()  # left by a bench that was killed; empty, or rmdir says why not
        if version == 2:
            enable_memory(parent)
        path.mkdir()
        cgroup = cls(version, path)
        if version == 2:
            cgroup.write("memory.max", limit_bytes)
            cgroup.write("memory.swap.max", 0, optional=True)
        else:
            cgroup.write("memory.limit_in_bytes", limit_bytes)
            cgroup.write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)  # RAM + swap: no swap
        return cgroup

    def wrap(self, command: list[str]) -> list[str]:
        """The command, started inside this cgroup."""
        return ["sh", "-c", ENTER, str(self.path / "cgroup.procs"), *command]

    def oom_kills(self) -> int:
        """How many processes of this cgroup the OOM killer has killed."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        events = self.path / name
        if not events.is_file():
            return 0
        counts = dict(line.split() for line in events.read_text().splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def peak_bytes(self) -> int | None:
        """The most memory the cgroup's processes held at once (None where the kernel keeps no peak)."""
        file = self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(file.read_text()) if file.is_file() else None

    def remove(self) -> None:
        """Once its processes are gone (the kernel may take a moment to let an exited one go)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        raise ZeroliteError(f"cannot remove the cgroup {self.path}: "
                            f"processes are still in it ({self.path / 'cgroup.procs'})")

    def write(self, name: str, value: int, optional: bool = False) -> None:
        file = self.path / name
        if optional and not file.exists():
            return
        file.write_text(f"{value}\n")


def enable_memory(parent: Path) -> None:
    """v2: a child gets the memory controller's files only where its parent hands it down."""
    subtree = parent / "cgroup.subtree_control"
    if "memory" not in subtree.read_text().split():
        subtree.write_text("+memory\n")
