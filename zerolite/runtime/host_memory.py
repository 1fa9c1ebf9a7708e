"""What this process may still take of host memory: the machine's available memory, or less where a
memory cgroup (a container's, a job scheduler's, tools/bench_cgroup's) limits it, since psutil sees the
machine's and a batch sized by it would meet the cgroup's OOM killer.

    room = host_room()    # bytes

Every cgroup from this process's own up to the root limits it (v1's memory controller, or v2's
unified hierarchy); the page cache a cgroup holds (its inactive file pages) is counted as room, as
the kernel reclaims it before it kills anything.
"""

from __future__ import annotations

from pathlib import Path

import psutil

SYSFS = Path("/sys/fs/cgroup")
# (limit, usage, reclaimable page cache in memory.stat) of each version's memory controller
V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
V2 = ("memory.max", "memory.current", "inactive_file")


def host_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = SYSFS) -> int:
    room = psutil.virtual_memory().available
    for folder, names in cgroup_folders(proc_cgroup, root):
        while folder != root and root in folder.parents:
            limit = read_number(folder / names[0])
            if limit is not None:
                usage = read_number(folder / names[1]) or 0
                room = min(room, max(limit - usage + reclaimable(folder / "memory.stat", names[2]), 0))
            folder = folder.parent
    return room


def cgroup_folders(proc_cgroup: Path, root: Path) -> list[tuple[Path, tuple[str, str, str]]]:
    """This process's memory cgroup folders (v1's, v2's) where they are visible: a cgroup namespace
    shows its own as the mount's top folder."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            candidates, names = [root / "memory" / relative, root / "memory"], V1
        elif controllers == "":
            candidates, names = [root / relative, root / "unified" / relative], V2
        else:
            continue
        folder = next((folder for folder in candidates if (folder / names[0]).is_file()), None)
        if folder is not None:
            found.append((folder, names))
    return found


def read_number(file: Path) -> int | None:
    """A limit or usage file's number; None where there is none (no file, v2's "max")."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def reclaimable(stat: Path, name: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except OSError:
        pass
    return 0
