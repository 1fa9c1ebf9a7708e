"""How much memory a node holds when several torchrun ranks run one model from host memory.

    python tools/bench_ranks.py --model /work/bench/llama19/layout --ranks 2 --json out.json

Runs `zerolite generate --offload cpu --device cpu` once as one process and once under torchrun
with --ranks ranks on this node, and samples every process of each run (five times a second):
  - node memory: the sum over its processes of PSS (proportional set size: a page mapped by two
    processes counts half in each), so the shared host copy counts once, as it takes the node's RAM
  - each process's own memory: its private pages (RSS less the pages it shares)
  - the host copy: the shared memory the node holds (Shmem in /proc/meminfo, less before the run)
and prints them with the target of issue 18: node memory at most one copy + 0.6 GB per rank.
Peaks are over the whole run, loading included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from zerolite.layout.folder import Layout

PER_RANK_TARGET = 0.6e9


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rollup(pid: int) -> dict[str, int]:
    """A process's memory (bytes) from /proc/PID/smaps_rollup."""
    figures = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        figures[name.rstrip(":")] = int(value) * 1024
    return figures


class Sampler:
    """Peaks of node memory (sum of PSS), of each process's private memory, and of shared memory,
    over every process under root that imports zerolite (torchrun's agent left out)."""

    def __init__(self, root: int, shmem_before: int):
        self.root = root
        self.shmem_before = shmem_before
        self.node_peak = 0
        self.private_peak: dict[int, int] = {}
        self.shmem_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for process in self.workers():
                try:
                    figures = rollup(process.pid)
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    continue
                total += figures["Pss"]
                private = figures["Private_Clean"] + figures["Private_Dirty"]
                self.private_peak[process.pid] = max(self.private_peak.get(process.pid, 0), private)
            self.node_peak = max(self.node_peak, total)
            self.shmem_peak = max(self.shmem_peak, meminfo("Shmem") - self.shmem_before)
            time.sleep(0.2)

    def workers(self) -> list[psutil.Process]:
        try:
            family = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        found = []
        for process in family:
            try:
                command = " ".join(process.cmdline())
                if "zerolite" in command and "torch.distributed.run" not in command:
                    found.append(process)
            except psutil.NoSuchProcess:
                continue
        return found

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(command: list[str]) -> dict:
    shmem_before = meminfo("Shmem")
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(process.pid, shmem_before)
    _, stderr = process.communicate()
    sampler.stop()
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{stderr}")
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "node_bytes": sampler.node_peak,
        "private_bytes_per_process": sorted(sampler.private_peak.values(), reverse=True),
        "shared_memory_bytes": sampler.shmem_peak,
        "summary": [line for line in stderr.splitlines() if "new tokens" in line],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A layout (held whole in host memory: --offload cpu).")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="Prompts per rank.")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    copy = Layout.open(args.model).manifest.data_bytes  # every block: --offload cpu holds them all in host memory
    with tempfile.TemporaryDirectory() as folder:
        prompts = Path(folder, "prompts.jsonl")
        prompts.write_text("".join(json.dumps({"id": i, "input_ids": [1, 100 + i, 200 + i, 300 + i]}) + "\n"
                                   for i in range(args.prompts * args.ranks)))
        generate = ["-m", "zerolite", "generate", "--model", args.model, "--offload", "cpu", "--device", "cpu",
                    "--input", str(prompts), "--batch-size", "1", "--max-new-tokens", str(args.new_tokens)]
        one = run([sys.executable, *generate, "--output", str(Path(folder, "one.jsonl"))])
        ranks = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                     *generate, "--output", str(Path(folder, "ranks.jsonl"))])
        same = Path(folder, "one.jsonl").read_text() == Path(folder, "ranks.jsonl").read_text()

    target = copy + args.ranks * PER_RANK_TARGET
    result = {"model": args.model, "copy_bytes": copy, "ranks": args.ranks, "one_process": one, "torchrun": ranks,
              "target_bytes": int(target), "met": ranks["node_bytes"] <= target, "same_output": same}
    gb = 1e9
    print(f"model in host memory: {copy / gb:.3f} GB ({args.model})")
    for name, figures in (("1 process", one), (f"{args.ranks} ranks", ranks)):
        private = ", ".join(f"{b / gb:.3f}" for b in figures["private_bytes_per_process"])
        print(f"{name:>9}: node {figures['node_bytes'] / gb:.3f} GB (sum of PSS, peak); shared memory "
              f"{figures['shared_memory_bytes'] / gb:.3f} GB; private per process {private} GB; {figures['seconds']} s")
    print(f"target: node memory <= one copy + 0.6 GB per rank = {target / gb:.3f} GB: "
          f"{'met' if result['met'] else 'NOT met'} ({ranks['node_bytes'] / gb:.3f} GB); "
          f"{args.ranks} private copies would take {args.ranks * copy / gb:.3f} GB for the weights alone; "
          f"outputs {'identical' if same else 'DIFFER'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
