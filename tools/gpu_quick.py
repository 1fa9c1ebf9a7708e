#!/usr/bin/env python3
"""The GPU in at most ~9 minutes, with no network: what a short loan of a GPU machine should bring back.

    tools/gpu_quick.sh "$OUT"                           # on the GPU machine: wheels, the extension, then this
    python tools/gpu_quick.py --out DIR [--budget-s 480] [--scratch DIR] [--steps copy,matmul,...]
    python tools/gpu_quick.py --dry-run --out DIR       # here: every step on the simulated device, tiny shapes

Steps, each in a process of its own with its own time limit (a step that fails, hangs or runs out
of time is recorded as such and the others still run; a step that no longer fits the budget is
skipped), the report written again after each:
  machine   GPU, memory, driver, PCIe generation and width, NUMA nodes and the GPU's, CPUs, versions;
  copy      pinned host-to-GPU rate at 256 MiB and at a Llama-70B layer's size (1.71 GB in bf16),
            alone and beside matmuls running on the compute stream;
  matmul    an 8192 x 28672 weight at 1, 16, 64 and 256 rows: bf16 F.linear; int8 and int4 as
            zerolite runs them on a GPU today (Int8Linear / Int4Linear: dequantise, then matmul);
            torch's fused weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm);
  folder    an 8-layer bf16 Llama folder with a 70B's layers (13.7 GB), written straight as
            safetensors, then planned in place (only a manifest written);
  stream-*  that folder streamed in place through zerolite.load at batch 1 and 32, greedy:
            pinned (every layer streamed from pinned host memory), resident (4 resident + 4
            streamed), disk (from disk, nothing held), kv (--kv-offload 0.5, a 1k prompt); each
            decode step's bytes over its time, against the pinned rate (in the report);
  profile   torch.profiler over two decode steps (every layer streamed from pinned memory):
            copy-stream busy share, its longest gap, copy/kernel overlap;
  tests-*   the cuda-marked tests on the real device only (not their sim parameters; test_serve,
            which needs uvicorn, left out): the K/V and tiers cases under TORCH_CUDA_SANITIZER=1,
            then the rest.
Written under --out: gpu_quick.json, gpu_quick.md, gpu_quick.log (every step's output),
gpu_quick_tests.log, gpu_quick_trace.json.gz (batch 1's profile).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # on the GPU machine zerolite is not installed: the extension is built into ROOT/zerolite
    sys.path.insert(1, str(ROOT))

MiB = 1 << 20
SANITIZER_FINDING = "CSAN detected a possible data race"


# ---------------------------------------------------------------------------------------------
# shapes


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    copy_sizes: tuple[int, ...]     # bytes; the last is a layer's
    matmul_rows: tuple[int, ...]
    batches: tuple[int, ...]
    prompt: int                     # tokens of the streaming cases' prompts
    kv_prompt: int                  # the kv case's
    new_tokens: int                 # greedy tokens of each generate (the first is the prefill's)
    disk_new_tokens: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """A Llama decoder layer's weights: q, k, v, o, gate, up, down and two norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h

    @property
    def layer_bytes(self) -> int:
        return 2 * self.layer_params  # bf16

    def kv_bytes_per_token(self) -> int:
        """One token's K and V in one layer, bf16."""
        return 2 * self.kv_heads * self.head_dim * 2


REAL = Shapes(hidden=8192, intermediate=28672, heads=64, kv_heads=8, layers=8, vocab=4096,
              copy_sizes=(256 * MiB, 0), matmul_rows=(1, 16, 64, 256), batches=(1, 32), prompt=8, kv_prompt=1024,
              new_tokens=6, disk_new_tokens=3)
TINY = Shapes(hidden=128, intermediate=384, heads=4, kv_heads=2, layers=8, vocab=512,
              copy_sizes=(1 * MiB, 0), matmul_rows=(1, 16, 64, 256), batches=(1, 32), prompt=8, kv_prompt=64,
              new_tokens=4, disk_new_tokens=3)
LAYER_70B_BYTES = REAL.layer_bytes  # 1,711,308,800


def shapes(dry: bool) -> Shapes:
    return TINY if dry else REAL


def copy_sizes(s: Shapes) -> list[int]:
    return [size or s.layer_bytes for size in s.copy_sizes]


# ---------------------------------------------------------------------------------------------
# the steps' plan (the parent)


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int       # on a GPU
    dry_limit_s: int   # in a dry run
    floor_s: int       # kept for it by the steps before it; with less left it is skipped


STEPS = (
    Step("machine", 30, 20, 5),
    Step("copy", 60, 30, 15),
    Step("matmul", 60, 30, 15),
    Step("folder", 150, 30, 20),
    Step("stream-pinned", 80, 40, 20),
    Step("stream-resident", 60, 40, 20),
    Step("stream-disk", 100, 40, 20),
    Step("stream-kv", 80, 40, 20),
    Step("profile", 60, 40, 15),
    Step("tests-sanitized", 120, 40, 30),
    Step("tests", 100, 40, 30),
)
STREAM_CASES = {
    # name: (zerolite.load's policy keywords, apart from gpu_memory for "resident"), what it measures
    "pinned": (dict(offload="cpu", gpu_memory=0), "every layer streamed from pinned host memory"),
    "resident": (dict(offload="cpu"), "4 layers resident on the device, 4 streamed from pinned host memory"),
    "disk": (dict(offload="nvme", cpu_memory=0, gpu_memory=0), "every layer read from disk, nothing held"),
    "kv": (dict(offload="cpu", gpu_memory=0, kv_offload=0.5), "every layer streamed from pinned memory, half the layers' K/V in host memory, a long prompt"),
}
TESTS_SANITIZED_K = "(kv or tiers)"
HUNG_LIMIT_S = 45
# For the tests: a step that saves a figure and then hangs, and a cap on every step's limit.
HANG_VARIABLE, LIMIT_VARIABLE = "GPU_QUICK_HANG", "GPU_QUICK_LIMIT_S"


def streams(step: str) -> bool:
    """Whether the step runs the model streamed (a hang in one predicts the others')."""
    return step.startswith("stream-") or step == "profile"


def now() -> str:
    return time.strftime("%H:%M:%S")


def say(text: str) -> None:
    print(f"gpu_quick {now()} {text}", file=sys.stderr, flush=True)


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def cuda_test_files() -> list[str]:
    """The test modules with cuda-marked tests, less those that import what the GPU image lacks at
    collection (test_serve: uvicorn): collecting only these is faster, and a module that fails to
    import elsewhere cannot stop the run (--continue-on-collection-errors besides)."""
    return [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))
            if path.name not in CUDA_TESTS_LEFT_OUT and "mark.cuda" in path.read_text(errors="replace")]


CUDA_TESTS_LEFT_OUT = {"test_serve.py"}


def pytest_command(dry: bool, sanitized: bool) -> list[str]:
    """The cuda-marked tests, their real-device parameters only (a dry run: one cheap case's sim parameter)."""
    base = [sys.executable, "-m", "pytest", *cuda_test_files(), "-m", "cuda", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "-rfE", "--continue-on-collection-errors"]
    if dry:
        k = "sim and kv_cache_partly" if sanitized else "sim and registered_in_chunks"
        return [*base, "-k", k]
    k = f"not sim and {TESTS_SANITIZED_K}" if sanitized else f"not sim and not {TESTS_SANITIZED_K}"
    workers = ["-n", "6"] if _has_module("xdist") else []
    return [*base, "-k", k, *workers]


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def pick_scratch(given: str | None) -> Path:
    """Where the model folder goes: given, else the first of /tmp and build/ not in memory (tmpfs)
    with room for it; a folder in memory would make the disk case a memory case."""
    if given:
        return Path(given).resolve()
    candidates = [Path("/var/tmp"), Path("/tmp"), ROOT / "build"]
    for base in candidates:
        with contextlib.suppress(OSError):
            base.mkdir(parents=True, exist_ok=True)
            if filesystem_type(base) != "tmpfs" and shutil.disk_usage(base).free > 20e9:
                return base / "zerolite-gpu-quick"
    return Path("/tmp") / "zerolite-gpu-quick"


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem path lies on (/proc/mounts' longest mount point above it)."""
    best, kind = "", None
    with contextlib.suppress(OSError):
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


class Parent:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run
        self.out: Path = args.out
        self.scratch: Path = args.scratch
        self.started = time.time()
        self.deadline = self.started + args.budget_s
        self.report: dict = {
            "tool": "tools/gpu_quick.py", "dry_run": self.dry, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "budget_s": args.budget_s, "scratch": str(self.scratch), "commit": git_commit(),
            "shapes": {"hidden": shapes(self.dry).hidden, "intermediate": shapes(self.dry).intermediate,
                       "heads": shapes(self.dry).heads, "kv_heads": shapes(self.dry).kv_heads,
                       "layers": shapes(self.dry).layers, "layer_bytes": shapes(self.dry).layer_bytes},
            "steps": {}, "machine": {}, "copy": {}, "matmul": {}, "folder": {},
            "streaming": {case: {} for case in STREAM_CASES}, "profile": {}, "tests": {},
        }
        self.streaming_hung = False
        self.log = self.out / "gpu_quick.log"
        self.tests_log = self.out / "gpu_quick_tests.log"

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.scratch / "results").mkdir(parents=True, exist_ok=True)
        for path in (self.log, self.tests_log):
            path.write_text("")
        chosen = [step for step in STEPS if self.args.steps is None or step.name in self.args.steps]
        say(f"{'dry run' if self.dry else 'GPU run'}: {len(chosen)} steps within {self.args.budget_s} s; out {self.out}, "
            f"scratch {self.scratch}")
        for i, step in enumerate(chosen):
            later_floor = sum(later.floor_s for later in chosen[i + 1:])
            left = self.deadline - time.time()
            limit = step.dry_limit_s if self.dry else step.limit_s
            limit = min(limit, int(os.environ.get(LIMIT_VARIABLE, limit)))
            if self.streaming_hung and streams(step.name):
                limit = min(limit, HUNG_LIMIT_S)  # one hung: the next would likely hang alike; keep time for the tests
            floor = min(step.floor_s, limit)
            timeout = min(limit, left - later_floor)
            if timeout < floor:
                timeout = min(limit, left)  # what the later ones may not need
            if timeout < floor:
                self.report["steps"][step.name] = {"status": "skipped", "why": f"{left:.0f} s of the budget left"}
                say(f"{step.name}: skipped ({left:.0f} s of the budget left)")
                self.write()
                continue
            self.run_step(step, int(timeout))
            self.write()
            # The disk case may run out of time on a slow disk alone; any other streaming step's timing out is a hang.
            if streams(step.name) and step.name != "stream-disk" and self.report["steps"][step.name]["status"] == "timed out":
                self.streaming_hung = True
        failed = [name for name, s in self.report["steps"].items() if s["status"] != "ok"]
        self.report["seconds"] = round(time.time() - self.started, 1)
        self.write()
        say(f"done in {self.report['seconds']} s; report {self.out / 'gpu_quick.md'}"
            + (f"; not ok: {', '.join(failed)}" if failed else ""))
        # The headline and the steps' verdicts (what a look at the end of the output should show); the rest is in the files.
        text = (self.out / "gpu_quick.md").read_text()
        print(text[text.index("## Headline"):text.index("## Machine")].rstrip())
        return 1 if failed else 0

    def run_step(self, step: Step, timeout: int) -> None:
        say(f"{step.name}: started (limit {timeout} s)")
        tests = step.name.startswith("tests")
        if tests:  # in a folder of its own: pytest's pruning of old runs in its default one never meets another pytest's
            command = [*pytest_command(self.dry, step.name == "tests-sanitized"), "--basetemp", str(self.scratch / f"pytest-{step.name}")]
        else:
            command = [sys.executable, str(Path(__file__).resolve()), "--child", step.name, "--scratch", str(self.scratch),
                       "--out", str(self.out), "--deadline", str(time.time() + timeout - 3)] + (["--dry-run"] if self.dry else [])
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "TRANSFORMERS_VERBOSITY": "error", "ZEROLITE_CACHE": str(self.scratch / "cache")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        if step.name == "tests-sanitized" and not self.dry:  # a CPU build of torch has no CUDA to watch
            env["TORCH_CUDA_SANITIZER"] = "1"
        results = self.scratch / "results" / f"{step.name}.json"
        results.unlink(missing_ok=True)
        log = self.tests_log if tests else self.log
        with open(log, "a") as sink:
            sink.write(f"\n===== {step.name} {now()}: {' '.join(command)}\n")
            sink.flush()
            offset = sink.tell()
            started = time.perf_counter()
            try:
                process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
                returncode = self.wait(process, step, results, started + timeout)
            except OSError as e:
                sink.write(f"could not start: {e}\n")
                returncode = 127
            seconds = time.perf_counter() - started
        cap(log)
        output = read_from(log, offset)
        status = "ok" if returncode == 0 else ("timed out" if returncode is None else f"failed (exit {returncode})")
        record = {"status": status, "seconds": round(seconds, 1), "limit_s": timeout}
        data = {}
        if results.is_file():
            with contextlib.suppress(ValueError):
                data = json.loads(results.read_text())
        if "error" in data:
            record["error"] = data.pop("error")
            record["traceback"] = data.pop("traceback", None)
        if tests:
            data = {**tests_summary(output, command, returncode), "sanitizer": env.get("TORCH_CUDA_SANITIZER") == "1"}
        if status != "ok":
            record["tail"] = tail(output, 25)
        self.report["steps"][step.name] = record
        self.merge(step.name, data)
        say(f"{step.name}: {status} in {seconds:.1f} s" + (f": {record['error']}" if "error" in record else "")
            + headline(step.name, data))

    def wait(self, process: subprocess.Popen, step: Step, results: Path, until: float) -> int | None:
        """The step's exit status, or None once it ran out of time (killed, with its children). Meanwhile
        what it saved so far goes into the report every few seconds, so that a kill of this whole
        script still leaves it."""
        seen = None
        while True:
            try:
                return process.wait(timeout=max(min(5.0, until - time.perf_counter()), 0.01))
            except subprocess.TimeoutExpired:
                pass
            if time.perf_counter() >= until:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):  # one stuck in the driver is left behind
                    process.wait(timeout=20)
                return None
            with contextlib.suppress(OSError, ValueError):
                stamp = results.stat().st_mtime_ns
                if stamp != seen:
                    seen = stamp
                    self.report["steps"][step.name] = {"status": "running"}
                    self.merge(step.name, {k: v for k, v in json.loads(results.read_text()).items() if k != "traceback"})
                    self.write()

    def merge(self, name: str, data: dict) -> None:
        if name.startswith("stream-"):
            self.report["streaming"][name.removeprefix("stream-")] = data
        elif name.startswith("tests"):
            self.report["tests"][name] = data
        else:
            self.report[name] = data

    def write(self) -> None:
        derive(self.report)
        write_atomically(self.out / "gpu_quick.json", json.dumps(self.report, indent=1, default=str))
        write_atomically(self.out / "gpu_quick.md", markdown(self.report))


LOG_LIMIT = 15 * MiB  # what the GPU machine gives back is at most 16 MiB a file


def cap(path: Path) -> None:
    """Keeps a log under LOG_LIMIT: its first and last parts, the middle cut out."""
    with contextlib.suppress(OSError):
        size = path.stat().st_size
        if size > LOG_LIMIT:
            with open(path, "rb") as f:
                head = f.read(LOG_LIMIT // 4)
                f.seek(size - LOG_LIMIT // 2)
                rest = f.read()
            path.write_bytes(head + f"\n[... {size - len(head) - len(rest)} bytes cut ...]\n".encode() + rest)


def read_from(path: Path, offset: int) -> str:
    """What a step wrote to its log (its last MiB where cap() cut the log since)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(offset if offset <= size else max(size - MiB, 0))
        return f.read().decode(errors="replace")


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return done.stdout.strip() or None
    return None


def tests_summary(output: str, command: list[str], returncode: int | None) -> dict:
    counts = {}
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b", line)
        if found and re.search(r" in [\d.]+s", line):
            counts = {what: int(n) for n, what in found}
            break
    lines = output.splitlines()
    findings = ["\n".join(lines[i:i + 6]) for i, line in enumerate(lines) if SANITIZER_FINDING in line]
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return {"command": " ".join(command[1:]), "returncode": returncode, "counts": counts,
            "sanitizer_findings": findings, "failed": failed[:30]}


def headline(name: str, data: dict) -> str:
    """The step's main figures, for the progress line."""
    with contextlib.suppress(Exception):
        if name == "machine":
            return f": {data.get('gpu', {}).get('name')} {data.get('pcie')}"
        if name == "copy":
            return ": " + ", ".join(f"{r['label']} {r['gbps']} GB/s" for r in data.get("rates", []))
        if name == "matmul":
            return ": " + ", ".join(f"{row['rows']} rows int4 today/fused/bf16 {row.get('int4_today_ms')}/"
                                    f"{row.get('int4_fused_ms')}/{row.get('bf16_ms')} ms" for row in data.get("rows", []))
        if name.startswith("stream-"):
            return ": " + ", ".join(f"batch {b}: step {r.get('median_step_s')} s" for b, r in data.get("batches", {}).items())
        if name == "profile":
            return ": " + ", ".join(f"batch {b}: copy busy {r.get('copy_busy_share')}" for b, r in data.get("batches", {}).items())
        if name.startswith("tests"):
            return f": {data.get('counts')}, sanitizer findings {len(data.get('sanitizer_findings', []))}"
    return ""


def derive(report: dict) -> None:
    """Each streaming case's bytes per step over its time, against the pinned rate at a layer's size."""
    rates = {r["label"]: r for r in report.get("copy", {}).get("rates", [])}
    layer = rates.get("layer alone", {}).get("gbps")
    disk = report.get("folder", {}).get("disk_gbps")
    report["pinned_gbps"], report["disk_gbps"] = layer, disk
    for name, case in report["streaming"].items():
        for result in case.get("batches", {}).values():
            step, moved = result.get("median_step_s"), result.get("moved_bytes_per_step")
            if step and moved:
                result["moved_gbps"] = round(moved / step / 1e9, 3)
                result["share_of_pinned_rate"] = round(moved / step / 1e9 / layer, 3) if layer else None
                result["link_bound_step_s"] = round(moved / (layer * 1e9), 4) if layer else None
                if name == "disk" and disk:  # its bound is the disk's rate, lower than the link's
                    result["share_of_disk_rate"] = round(moved / step / 1e9 / disk, 3)
                    result["disk_bound_step_s"] = round(moved / (disk * 1e9), 4)
    report["headline"] = headline_figures(report)


def headline_figures(report: dict) -> dict:
    """What the issue asks the note to quote: the link-busy share, the step against the link bound,
    int4's speed against bf16."""
    figures: dict = {"pinned_gbps_at_a_layer": report.get("pinned_gbps"), "disk_gbps": report.get("disk_gbps")}
    with contextlib.suppress(Exception):
        figures["pinned_gbps_at_a_layer_beside_matmuls"] = report["copy"]["rates"][1]["beside_gbps"]
    figures = {k: v for k, v in figures.items() if v is not None}
    for batch in ("1", "32"):
        with contextlib.suppress(Exception):
            figures[f"copy_busy_share_batch_{batch}"] = report["profile"]["batches"][batch]["copy_busy_share"]
            figures[f"longest_copy_gap_ms_batch_{batch}"] = report["profile"]["batches"][batch]["longest_copy_gap_ms"]
    for batch in ("1", "32"):
        with contextlib.suppress(Exception):
            pinned = report["streaming"]["pinned"]["batches"][batch]
            figures[f"pinned_step_s_batch_{batch}"] = pinned["median_step_s"]
            figures[f"pinned_link_bound_s_batch_{batch}"] = pinned.get("link_bound_step_s")
            figures[f"pinned_share_of_link_batch_{batch}"] = pinned.get("share_of_pinned_rate")
    for row in report.get("matmul", {}).get("rows", []):
        for variant in ("int4_fused", "int4_today"):
            speedup = ratio(row.get("bf16_ms"), row.get(f"{variant}_ms"))
            if speedup:
                figures[f"{variant}_vs_bf16_rows_{row['rows']}"] = speedup
    return figures


# ---------------------------------------------------------------------------------------------
# the markdown report


def cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m = report.get("machine", {})
    gpu = m.get("gpu") or {}
    parts = [f"# zerolite gpu_quick{' (dry run: simulated device, tiny shapes)' if report['dry_run'] else ''}",
             f"{report['started']}, commit {report.get('commit') or 'unknown'}, budget {report['budget_s']} s"
             + (f", took {report['seconds']} s" if "seconds" in report else "")]

    figures = report.get("headline") or {}
    parts.append("## Headline\n\n" + (table(["figure", "value"], [[k, v] for k, v in figures.items()]) if figures else "nothing yet")
                 + "\n\n(copy busy share: of the profiled decode steps' GPU time; share of link: a step's bytes over its "
                 "time over the pinned rate at a layer's size; x vs bf16: bf16's time over the variant's, above 1 faster)")
    parts.append("## Steps\n\n" + table(["step", "status", "seconds", "limit s", "error"],
                                        [[n, s["status"], s.get("seconds"), s.get("limit_s"), s.get("error") or s.get("why")]
                                         for n, s in report["steps"].items()]))

    parts.append("## Machine\n\n" + table(["what", "value"], [
        ["GPU", gpu.get("name")], ["GPU memory (GiB)", gpu.get("memory_gib")], ["driver", m.get("driver")],
        ["PCIe (current / max)", m.get("pcie")], ["GPU's NUMA node", m.get("gpu_numa_node")],
        ["NUMA nodes", m.get("numa_nodes")], ["CPUs (usable / all)", f"{m.get('cpus_usable')} / {m.get('cpus')}" if m else None],
        ["host memory (GiB)", m.get("host_memory_gib")], ["scratch filesystem", m.get("scratch_fs")],
        ["torch / CUDA", f"{m.get('torch')} / {m.get('cuda')}" if m else None], ["transformers", m.get("transformers")],
        ["python", m.get("python")]]))

    copy = report.get("copy", {})
    parts.append("## Pinned host-to-device copies\n\n"
                 + (f"PCIe link right after the copies (generation, width): {copy['pcie_after_copies']}\n\n"
                    if copy.get("pcie_after_copies") else "") + table(
        ["size", "MB", "GB/s", "repeats", "beside matmuls: GB/s", "matmuls covered the copies"],
        [[r["label"], round(r["bytes"] / 1e6, 1), r.get("gbps"), r.get("repeats"), r.get("beside_gbps"), r.get("matmul_covered")]
         for r in copy.get("rates", []) if "alone" in r["label"]]))

    mm = report.get("matmul", {})
    parts.append(f"## Matmuls, weight {mm.get('in_features')} x {mm.get('out_features')} (ms per call; x: against bf16)\n\n"
                 + table(["rows", "bf16", "int8 today", "int8 fused", "int4 today", "int4 fused", "int4 fused x", "int4 today x"],
                         [[r["rows"], r.get("bf16_ms"), r.get("int8_today_ms"), r.get("int8_fused_ms"), r.get("int4_today_ms"),
                           r.get("int4_fused_ms"), ratio(r.get("bf16_ms"), r.get("int4_fused_ms")),
                           ratio(r.get("bf16_ms"), r.get("int4_today_ms"))] for r in mm.get("rows", [])])
                 + "".join(f"\n\n{k}: {v}" for k, v in mm.get("errors", {}).items())
                 + (f"\n\nfused int4 against its dense weight, max relative error: {mm.get('int4_fused_max_rel_err')}"
                    if "int4_fused_max_rel_err" in mm else ""))

    f = report.get("folder", {})
    parts.append("## Model folder\n\n" + table(["what", "value"], [
        ["layers x bytes", f"{f.get('layers')} x {f.get('layer_bytes')}" if f else None], ["GB written", gb(f.get("bytes"))],
        ["write s (with fsync)", f.get("write_s")], ["write GB/s", f.get("write_gbps")], ["page cache dropped", f.get("cache_dropped")],
        ["disk read GB/s (a layer's shard, O_DIRECT, 256 MiB requests)", f.get("disk_gbps")],
        ["reused", f.get("reused")], ["O_DIRECT opens", f.get("direct_io")], ["in-place layout", f.get("layout")]]))

    rows = []
    for name, case in report["streaming"].items():
        for batch, r in case.get("batches", {}).items():
            note = r.get("error") or r.get("skipped") or (f"{r['share_of_disk_rate']} of the disk's rate" if "share_of_disk_rate" in r else None)
            rows.append([name, batch, r.get("median_step_s"), r.get("steps"), r.get("tokens_per_s"), gb(r.get("moved_bytes_per_step")),
                         r.get("moved_gbps"), r.get("share_of_pinned_rate"), r.get("link_bound_step_s"), r.get("read_gb_per_forward"),
                         note])
    parts.append(f"## Streaming in place (pinned rate {cell(report.get('pinned_gbps'))} GB/s)\n\n"
                 + "\n".join(f"- {name}: {STREAM_CASES[name][1]}; " + plan_line(case) for name, case in report["streaming"].items())
                 + "\n\n" + table(["case", "batch", "median step s", "steps", "tokens/s", "GB moved/step", "GB/s",
                                   "of pinned rate", "link bound s", "GB read/forward", "note"], rows))

    prof = report.get("profile", {})
    parts.append("## Profile of two decode steps (every layer streamed from pinned memory)\n\n" + table(
        ["batch", "window ms", "copy busy share", "longest copy gap ms", "copy/kernel overlap", "kernel busy share",
         "copies", "kernels", "source"],
        [[b, r.get("window_ms"), r.get("copy_busy_share"), r.get("longest_copy_gap_ms"), r.get("overlap_share"),
          r.get("kernel_busy_share"), r.get("copies"), r.get("kernels"), r.get("source")] for b, r in prof.get("batches", {}).items()])
        + (f"\n\n{prof['note']}" if prof.get("note") else ""))

    tests = report.get("tests", {})
    lines = []
    for name, t in tests.items():
        lines.append(f"- {name}: `{t.get('command')}`: {t.get('counts') or 'no summary line'}; "
                     + (f"sanitizer findings: {len(t.get('sanitizer_findings', []))}" if t.get("sanitizer") else "no sanitizer"))
        lines += [f"  - {line}" for line in t.get("failed", [])]
        lines += ["```\n" + finding + "\n```" for finding in t.get("sanitizer_findings", [])[:5]]
    parts.append("## CUDA tests (real device only)\n\n" + ("\n".join(lines) or "not run"))
    return "\n\n".join(parts) + "\n"


def ratio(a, b):
    return round(a / b, 2) if a and b else None


def gb(nbytes):
    return round(nbytes / 1e9, 3) if nbytes else None


def plan_line(case: dict) -> str:
    plan = case.get("plan")
    if not plan:
        return case.get("error", "not run")
    return (f"resident layers {plan['resident_layers']}, streamed {plan['streamed']}, of them from disk {plan['on_disk']}; "
            f"ring {plan['prefetch_depth']}, engine {plan.get('io_backend')}; load {case.get('load_s')} s")


# ---------------------------------------------------------------------------------------------
# the steps themselves (a child process each)


class Child:
    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.dry = args.dry_run
        self.shapes = shapes(self.dry)
        self.scratch: Path = args.scratch
        self.out: Path = args.out
        self.deadline: float = args.deadline
        self.results: dict = {}
        self.path = self.scratch / "results" / f"{name}.json"
        self._device = None

    def save(self, **values) -> None:
        self.results.update(values)
        write_atomically(self.path, json.dumps(self.results, indent=1, default=str))

    def left(self) -> float:
        return self.deadline - time.time()

    @property
    def device(self):
        """A zerolite Device: the GPU, or in a dry run the simulated one (tests/simulated_device.py)."""
        if self._device is None:
            if self.dry:
                sys.path.insert(0, str(ROOT / "tests"))
                from simulated_device import SimulatedDevice

                self._device = SimulatedDevice(seed=0, memory_bytes=4 << 30)
            else:
                import torch

                from zerolite.io.device import CudaDevice

                self._device = CudaDevice(torch.device("cuda", 0))
            self._device.adopt_thread()
        return self._device

    def prior(self, name: str) -> dict:
        """An earlier step's results (the folder's path)."""
        path = self.scratch / "results" / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}


def run_child(name: str, args: argparse.Namespace) -> int:
    child = Child(name, args)
    child.save()
    try:
        if os.environ.get(HANG_VARIABLE) == name:
            child.save(before_the_hang=True)
            time.sleep(3600)
        if name.startswith("stream-"):
            stream_case(child, name.removeprefix("stream-"))
        else:
            STEP_FUNCTIONS[name](child)
        return 0
    except BaseException as e:  # recorded, then the parent goes on with the next step
        child.save(error=f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", traceback=traceback.format_exc()[-3000:])
        traceback.print_exc()
        return 1


def run_quietly(command: list[str], timeout: int = 10) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def step_machine(c: Child) -> None:
    import platform

    import psutil

    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        with contextlib.suppress(OSError):
            nodes[node.name] = (node / "cpulist").read_text().strip()
    c.save(python=platform.python_version(), cpus=os.cpu_count(), cpus_usable=len(os.sched_getaffinity(0)),
           host_memory_gib=round(psutil.virtual_memory().total / 2**30, 1), numa_nodes=nodes or None,
           scratch_fs=filesystem_type(c.scratch), kernel=platform.release())
    fields = ["name", "memory.total", "driver_version", "pcie.link.gen.current", "pcie.link.gen.max",
              "pcie.link.width.current", "pcie.link.width.max", "pci.bus_id", "clocks.max.sm", "power.limit"]
    smi = run_quietly(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if smi:
        values = dict(zip(fields, [v.strip() for v in smi.splitlines()[0].split(",")]))
        bus = values.get("pci.bus_id", "")
        sysfs_bus = (bus[-12:] if len(bus) >= 12 else bus).lower()  # 00000000:18:00.0 -> 0000:18:00.0
        numa = None
        with contextlib.suppress(OSError, ValueError):
            numa = int(Path(f"/sys/bus/pci/devices/{sysfs_bus}/numa_node").read_text())
        c.save(nvidia_smi=values, driver=values.get("driver_version"), gpu_numa_node=numa,
               pcie=f"gen {values.get('pcie.link.gen.current')} x{values.get('pcie.link.width.current')} / "
                    f"gen {values.get('pcie.link.gen.max')} x{values.get('pcie.link.width.max')}")
        c.save(topology=run_quietly(["nvidia-smi", "topo", "-m"]))
    else:
        c.save(nvidia_smi=None, driver=None, pcie=None, gpu_numa_node=None)
    import torch
    import transformers

    c.save(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        c.save(gpu={"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
                    "multiprocessors": p.multi_processor_count})
    else:
        c.save(gpu={"name": "simulated device" if c.dry else None, "memory_gib": None})


class Clock:
    """Times work queued on a stream: device events on a GPU (and the simulated device), so the host's
    queueing is not counted."""

    def __init__(self, device, stream=None):
        self.device, self.stream = device, stream

    @contextlib.contextmanager
    def time(self, into: list):
        begin = self.device.record(self.stream, timing=True)
        yield
        end = self.device.record(self.stream, timing=True)
        end.synchronize()
        into.append(begin.elapsed_time(end) / 1e3)


def step_copy(c: Child) -> None:
    import torch

    device = c.device
    stream = device.new_stream()
    rates = []
    c.save(rates=rates)
    # Large matmuls (~1 TFLOP each on a GPU): a few dozen queued outlast the copies, well within the
    # launch queue (a full queue would block the host, and the copies would be queued after the matmuls ran).
    side = 8192 if not c.dry else 256
    weight = torch.randn(side, side, dtype=torch.bfloat16, device=device.torch_device)
    activations = torch.randn(side, side, dtype=torch.bfloat16, device=device.torch_device)
    for nbytes in copy_sizes(c.shapes):
        label = "256 MiB" if nbytes == c.shapes.copy_sizes[0] else "layer"
        host = device.pinned_empty(nbytes)
        host.fill_(1)
        target = device.empty(nbytes)
        device.wait_stream(stream, device.compute_stream())  # target comes from compute's memory
        device.copy(target, host, stream)  # warm
        device.synchronize(stream)
        repeats = max(2, min(20, int(4e9 // nbytes))) if not c.dry else 3
        seconds: list[float] = []
        with Clock(device, stream).time(seconds):
            for _ in range(repeats):
                device.copy(target, host, stream)
        result = {"label": f"{label} alone", "bytes": nbytes, "repeats": repeats, "seconds": seconds[0],
                  "gbps": round(nbytes * repeats / seconds[0] / 1e9, 3)}
        rates.append(result)
        c.save(rates=rates)
        # Beside matmuls: enough of them queued on compute to outlast the copies (1.5x their time alone).
        covered, beside = beside_matmuls(c, device, stream, lambda: [device.copy(target, host, stream) for _ in range(repeats)],
                                         seconds[0] * 1.5, weight, activations)
        result.update(beside_gbps=round(nbytes * repeats / beside / 1e9, 3), beside_seconds=beside, matmul_covered=covered)
        c.save(rates=rates)
        if not c.dry:  # an idle GPU's link may have stepped down to a lower generation when the machine step read it
            c.save(pcie_after_copies=run_quietly(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current",
                                                  "--format=csv,noheader"]))
        del host, target
    device.synchronize()


def beside_matmuls(c: Child, device, stream, copies, span_s: float, weight, activations) -> tuple[bool, float]:
    """Queues matmuls on compute for about span_s, then copies on stream; returns (whether the matmuls
    lasted at least as long as the copies, the copies' seconds)."""
    import torch.nn.functional as F

    if c.dry:  # the simulated device's compute runs on the calling thread: matmuls on a thread of their own
        stop = threading.Event()
        thread = threading.Thread(target=lambda: [F.linear(activations, weight) for _ in iter(lambda: stop.is_set(), True)],
                                  daemon=True)
        thread.start()
        seconds: list[float] = []
        with Clock(device, stream).time(seconds):
            copies()
        covered = thread.is_alive()
        stop.set()
        thread.join()
        return covered, seconds[0]
    one: list[float] = []
    with Clock(device).time(one):
        for _ in range(3):
            F.linear(activations, weight)
    count = max(1, min(500, int(span_s / (one[0] / 3)) + 1))
    matmul_begin = device.record(timing=True)
    for _ in range(count):
        F.linear(activations, weight)
    matmul_end = device.record(timing=True)
    begin = device.record(stream, timing=True)
    copies()
    end = device.record(stream, timing=True)
    device.synchronize()
    copy_s = begin.elapsed_time(end) / 1e3
    return matmul_begin.elapsed_time(matmul_end) / 1e3 >= copy_s, copy_s


def step_matmul(c: Child) -> None:
    import torch
    import torch.nn.functional as F

    from zerolite.quant.int4_packing import CANDIDATES, cpu_packing
    from zerolite.quant.linear import Int4Linear, Int8Linear
    from zerolite.quant.quantize import WeightScheme

    device = c.device
    on = device.torch_device
    cuda = on.type == "cuda"
    k, n, group = (8192, 28672, 64) if not c.dry else (256, 512, 64)
    c.save(in_features=k, out_features=n, group_size=group, rows=[], errors={})
    errors: dict = {}
    generator = torch.Generator(device=on).manual_seed(0)
    dense = (torch.randn(n, k, device=on, dtype=torch.bfloat16, generator=generator) * 0.02)
    q = torch.randint(0, 16, (n, k), device=on, dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // group, device=on, dtype=torch.bfloat16, generator=generator) * 0.01 + 0.001)
    zero = (torch.randn(n, k // group, device=on, dtype=torch.bfloat16, generator=generator) * 0.01)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, n, 2]: the kernels' form

    # Today's GPU path: the modules zerolite installs, dequantising at every call (dequantize=True, as on a device
    # with memory of its own). The packed bytes' order does not change the time.
    try:
        packing = cpu_packing()
    except Exception:  # this torch packs in a form zerolite does not read on this CPU: any order times the same
        packing = CANDIDATES[0]
    int4_today = Int4Linear(n, k, WeightScheme("int4", group, packing, torch.__version__), torch.bfloat16, None, True)
    int4_today.weight = torch.randint(0, 256, (n, k // 2), device=on, dtype=torch.uint8, generator=generator)
    int4_today.weight_scale_zero = scale_zero
    int8_today = Int8Linear(n, k, torch.bfloat16, None, True)
    int8_today.weight = torch.randint(-127, 128, (n, k), device=on, dtype=torch.int8, generator=generator)
    int8_today.weight_scale = scale[:, 0].contiguous()

    fused4 = None
    try:
        if cuda:
            packed_pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # uint8 [n, k/2], even columns high
            packed4 = torch.ops.aten._convert_weight_to_int4pack(packed_pairs, 8)
            fused4 = lambda x: torch.ops.aten._weight_int4pack_mm(x, packed4, group, scale_zero)  # noqa: E731
        else:
            packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
            fused4 = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, group, scale_zero)  # noqa: E731
        reference = ((q.to(torch.bfloat16) - 8).reshape(n, k // group, group) * scale[..., None] + zero[..., None]).reshape(n, k)
        x = torch.randn(16, k, device=on, dtype=torch.bfloat16, generator=generator)
        want, got = F.linear(x, reference).float(), fused4(x).float()
        c.save(int4_fused_max_rel_err=round(float((want - got).abs().max() / want.abs().max()), 5))
        del reference
    except Exception as e:
        errors["int4 fused"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        fused4 = None
    int8_weight, int8_scale = int8_today.weight, int8_today.weight_scale
    fused8 = lambda x: torch.ops.aten._weight_int8pack_mm(x, int8_weight, int8_scale)  # noqa: E731
    variants = {"bf16": lambda x: F.linear(x, dense), "int8_today": int8_today, "int8_fused": fused8,
                "int4_today": int4_today, "int4_fused": fused4}
    c.save(errors=errors)
    rows_out = []
    iterations = 20 if not c.dry else 3
    for rows in c.shapes.matmul_rows:
        x = torch.randn(rows, k, device=on, dtype=torch.bfloat16, generator=generator)
        result = {"rows": rows}
        for name, run in variants.items():
            if run is None:
                continue
            try:
                with torch.no_grad():
                    for _ in range(2):
                        run(x)
                    seconds: list[float] = []
                    with Clock(device).time(seconds) if cuda else host_time(seconds):
                        for _ in range(iterations):
                            run(x)
                result[f"{name}_ms"] = round(seconds[0] / iterations * 1e3, 4)
            except Exception as e:
                errors.setdefault(name, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        weight_bytes = {"bf16": 2 * n * k, "int8_today": n * k, "int8_fused": n * k, "int4_today": n * k // 2, "int4_fused": n * k // 2}
        for name, nbytes in weight_bytes.items():
            if result.get(f"{name}_ms"):
                result[f"{name}_weight_gbps"] = round(nbytes / (result[f"{name}_ms"] / 1e3) / 1e9, 1)
        rows_out.append(result)
        c.save(rows=rows_out, errors=errors)


@contextlib.contextmanager
def host_time(into: list):
    started = time.perf_counter()
    yield
    into.append(time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# the model folder


def llama_config(s: Shapes) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "num_hidden_layers": s.layers, "vocab_size": s.vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "head_dim": s.head_dim, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "dtype": "bfloat16", "torch_dtype": "bfloat16"}


def layer_tensors(s: Shapes, i: int) -> list[tuple[str, tuple[int, ...]]]:
    h, kv, p = s.hidden, s.kv_heads * s.head_dim, f"model.layers.{i}."
    return sorted([(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (s.intermediate, h)), (p + "mlp.up_proj.weight", (s.intermediate, h)),
                   (p + "mlp.down_proj.weight", (h, s.intermediate))])


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pattern: memoryview, norms: memoryview) -> int:
    """A bf16 safetensors file of these tensors: matrices filled from pattern (small random values,
    repeated), norm weights with ones; fsynced. Returns its bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = 2
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)  # the data starts page-aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in tensors:
            left = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            source = norms if len(shape) == 1 else pattern
            while left:
                chunk = source[: min(left, len(source))]
                f.write(chunk)
                left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def drop_cached(paths: list[Path]) -> bool:
    """Evicts the files from the page cache (fadvise works without root on clean pages), and drops
    the whole cache where allowed; says whether the latter worked."""
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_read_rate(path: Path, limit_s: float) -> dict:
    """The disk's own rate: path (a layer's shard, out of the page cache) read through zerolite's
    engine in 256 MiB requests, O_DIRECT, for at most limit_s."""
    from zerolite.io.engine import ALIGNMENT, IoEngine, aligned_empty

    engine = IoEngine()
    request = 256 * MiB
    buffer = aligned_empty(request)
    size = path.stat().st_size // ALIGNMENT * ALIGNMENT
    done, started = 0, time.perf_counter()
    while done < size and time.perf_counter() - started < limit_s:
        nbytes = min(request, size - done)
        engine.read(path, buffer[:nbytes], done)
        done += nbytes
    seconds = time.perf_counter() - started
    return {"disk_read_bytes": done, "disk_read_s": round(seconds, 3), "disk_gbps": round(done / seconds / 1e9, 3),
            "disk_engine": engine.backend}


def step_folder(c: Child) -> None:
    import concurrent.futures

    import torch

    from zerolite.convert.resolve import ensure_layout
    from zerolite.layout.folder import Layout

    s = c.shapes
    source = c.scratch / ("llama70b-8layers" if not c.dry else "tiny-8layers")
    config = llama_config(s)
    marker = source / ".complete"
    shards = {f"model-{i + 1:05d}-of-{s.layers + 1:05d}.safetensors": layer_tensors(s, i) for i in range(s.layers)}
    shards[f"model-{s.layers + 1:05d}-of-{s.layers + 1:05d}.safetensors"] = [
        ("lm_head.weight", (s.vocab, s.hidden)), ("model.embed_tokens.weight", (s.vocab, s.hidden)), ("model.norm.weight", (s.hidden,))]
    reused = marker.is_file() and json.loads(marker.read_text()) == config
    c.save(source=str(source), layers=s.layers, layer_bytes=s.layer_bytes, reused=reused)
    if not reused:
        shutil.rmtree(source, ignore_errors=True)
        source.mkdir(parents=True)
        (source / "config.json").write_text(json.dumps(config, indent=1))
        (source / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
        weight_map = {name: shard for shard, tensors in shards.items() for name, _ in tensors}
        pattern = memoryview((torch.randn(32 * MiB // 2, generator=torch.Generator().manual_seed(0)) * 0.02)
                             .to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
        norms = memoryview(torch.ones(max(s.hidden, 4096), dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # writes release the GIL: one file per writer
            sizes = list(pool.map(lambda item: write_safetensors(source / item[0], item[1], pattern, norms), shards.items()))
        write_s = time.perf_counter() - started
        total = sum(sizes)
        (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
        marker.write_text(json.dumps(config))
        c.save(bytes=total, write_s=round(write_s, 2), write_gbps=round(total / write_s / 1e9, 3))
    else:
        c.save(bytes=sum((source / shard).stat().st_size for shard in shards))
    c.save(cache_dropped=drop_cached([source / shard for shard in shards]))
    from zerolite.io.engine import supports_direct_io

    first = source / next(iter(shards))
    c.save(direct_io=supports_direct_io(first))
    c.save(**disk_read_rate(first, limit_s=6.0))
    started = time.perf_counter()
    folder = ensure_layout(str(source), c.scratch / "layouts", None, False, False)
    manifest = Layout.open(folder).manifest
    layers = set(manifest.layer_names)
    c.save(layout=str(folder), in_place=bool(manifest.in_place), plan_in_place_s=round(time.perf_counter() - started, 2),
           block_bytes={b.name: b.length for b in manifest.blocks},
           always_bytes=manifest.nbytes(b.name for b in manifest.blocks if b.name not in layers),
           widest_layer_bytes=max(manifest.block(name).length for name in layers))


# ---------------------------------------------------------------------------------------------
# streaming


def prompts(vocab: int, batch: int, length: int):
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(1234))


def stream_case(c: Child, case: str) -> None:
    import torch

    import zerolite
    from zerolite.generate.run import StepClock

    folder = c.prior("folder")
    if "layout" not in folder:
        raise RuntimeError("the folder step left no layout: nothing to stream")
    s = c.shapes
    policy = dict(STREAM_CASES[case][0])
    if case == "resident":  # the head, embeddings and norm always resident, then 4 layers
        policy["gpu_memory"] = folder["always_bytes"] + 4 * folder["widest_layer_bytes"] + folder["widest_layer_bytes"] // 2
    new_tokens = s.disk_new_tokens if case == "disk" else s.new_tokens
    prompt = s.kv_prompt if case == "kv" else s.prompt
    if case == "disk":
        c.save(cache_dropped=drop_cached([Path(p) for p in Path(folder["source"]).glob("*.safetensors")]))
    c.save(policy={k: v for k, v in policy.items()}, new_tokens=new_tokens, prompt_tokens=prompt, batches={})
    started = time.perf_counter()
    lm = zerolite.load(folder["layout"], device=c.device, show_progress=False, **policy)
    blocks = folder["block_bytes"]
    plan = {"resident_layers": sum(1 for name in lm.plan.resident if name in lm.layout.manifest.layer_names),
            "streamed": len(lm.plan.streamed), "on_disk": len(lm.plan.on_disk),
            "resident": list(lm.plan.resident), "prefetch_depth": lm.policy.prefetch_depth,
            "io_backend": lm.engine.backend}
    streamed_bytes = sum(blocks[name] for name in lm.plan.streamed)
    c.save(load_s=round(time.perf_counter() - started, 2), plan=plan, streamed_bytes=streamed_bytes)
    batches: dict = {}
    previous_s = 0.0
    try:
        for batch in s.batches:
            if previous_s and c.left() < previous_s * 1.3 + 5:
                batches[str(batch)] = {"skipped": f"{c.left():.0f} s left, the batch before took {previous_s:.0f} s"}
                c.save(batches=batches)
                continue
            ids = prompts(s.vocab, batch, prompt)
            read_before = lm.bytes_read
            began = time.perf_counter()

            def record(done: bool) -> None:
                """The batch's figures so far, saved after a slow step too (a second or more: from disk), so that
                a kill mid-batch leaves its steps; saving after a fast one would add to the next step's time."""
                if not done and (len(clock.times) < 2 or clock.times[-1] - clock.times[-2] < 1.0):
                    return
                steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
                median = statistics.median(steps) if steps else None
                forwards = max(len(clock.times) - 1, 1)
                kv_bytes = 0
                if policy.get("kv_offload"):  # the host layers' K/V crosses the link at every step (an estimate)
                    seq = prompt + new_tokens // 2
                    kv_bytes = int(policy["kv_offload"] * s.layers) * batch * seq * s.kv_bytes_per_token()
                batches[str(batch)] = {
                    "median_step_s": round(median, 5) if median else None, "steps": len(steps),
                    "step_s": [round(x, 5) for x in steps], "prefill_s": round(clock.prefill_s, 4),
                    "tokens_per_s": round(batch / median, 2) if median else None,
                    "generate_s": round(time.perf_counter() - began, 2), "weight_bytes_per_step": streamed_bytes,
                    "kv_bytes_per_step_estimate": kv_bytes, "moved_bytes_per_step": streamed_bytes + kv_bytes,
                    "read_gb_per_forward": round((lm.bytes_read - read_before) / forwards / 1e9, 3),
                    **({} if done else {"partial": True}),
                }
                c.save(batches=batches)

            clock = StepClock(lambda rows: record(False))
            try:
                with torch.no_grad():
                    lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
            except Exception as e:
                batches[str(batch)] = {**batches.get(str(batch), {}), "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
                c.save(batches=batches)
                continue
            previous_s = time.perf_counter() - began
            record(True)
        peak = lm.device.peak_allocated()
        c.save(peak_device_gib=round(peak / 2**30, 2) if peak else None)
    finally:
        lm.close()


# ---------------------------------------------------------------------------------------------
# the profile


def intervals_from_trace(trace: dict) -> list[tuple[str, object, float, float]]:
    """(kind, stream, start µs, end µs) of the GPU work in a torch.profiler chrome trace: "copy" for a
    host-to-device memcpy, "kernel" for a kernel (memsets and other copies left out)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    found = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        category, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        args = e.get("args") or {}
        stream = args.get("stream", e.get("tid"))
        start = float(e["ts"])
        # Kineto names a copy "Memcpy HtoD (Pinned -> Device)"; torch's own exporter "Memcpy", its kind in args
        if category == "gpu_memcpy" and ("HtoD" in name or args.get("copy kind") == "HtoD"):
            found.append(("copy", stream, start, start + float(e["dur"])))
        elif category == "kernel":
            found.append(("kernel", stream, start, start + float(e["dur"])))
    return found


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(intervals: list[tuple[str, object, float, float]], unit_s: float = 1e-6) -> dict:
    """The copy stream (the one with the most host-to-device copy time): its busy share of the window
    (first to last GPU work), its longest gap, and the share of its busy time that kernels on other
    streams ran beside it."""
    if not intervals:
        return {"window_ms": None, "copy_busy_share": None, "longest_copy_gap_ms": None, "overlap_share": None,
                "kernel_busy_share": None, "copies": 0, "kernels": 0}
    by_stream: dict = {}
    for kind, stream, start, end in intervals:
        if kind == "copy":
            by_stream[stream] = by_stream.get(stream, 0.0) + end - start
    copy_stream = max(by_stream, key=by_stream.get) if by_stream else None
    copies = union([(a, b) for kind, stream, a, b in intervals if kind == "copy" and stream == copy_stream])
    kernels = union([(a, b) for kind, stream, a, b in intervals if kind == "kernel" and stream != copy_stream])
    start, end = min(a for _, _, a, _ in intervals), max(b for _, _, _, b in intervals)
    window = max(end - start, 1e-12)
    edges = [start, *[x for span in copies for x in span], end]
    gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges) - 1, 2)]
    busy = length(copies)
    ms = unit_s * 1e3
    return {"window_ms": round(window * ms, 3), "copy_stream": str(copy_stream),
            "copy_busy_share": round(busy / window, 4), "longest_copy_gap_ms": round(max(gaps) * ms, 3) if gaps else None,
            "overlap_share": round(intersect(copies, kernels) / busy, 4) if busy else None,
            "kernel_busy_share": round(length(kernels) / window, 4),
            "copies": sum(1 for kind, *_ in intervals if kind == "copy"), "kernels": sum(1 for kind, *_ in intervals if kind == "kernel")}


@contextlib.contextmanager
def simulated_intervals(device, into: list):
    """On the simulated device, which a profiler cannot see: each copy's landing on its stream's
    thread, and each operation compute runs on the calling thread, on the host clock (seconds)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    original = device._landing

    def landing(dst, src, delayed):
        land = original(dst, src, delayed)

        def timed():
            started = time.perf_counter()
            land()
            into.append(("copy", threading.current_thread().name, started, time.perf_counter()))
        return timed

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            started = time.perf_counter()
            result = func(*args, **(kwargs or {}))
            if not func.is_view:
                into.append(("kernel", "compute", started, time.perf_counter()))
            return result

    device._landing = landing
    try:
        with Kernels():
            yield
    finally:
        device._landing = original


def step_profile(c: Child) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zerolite

    folder = c.prior("folder")
    if "layout" not in folder:
        raise RuntimeError("the folder step left no layout: nothing to profile")
    s = c.shapes
    device = c.device
    lm = zerolite.load(folder["layout"], device=device, show_progress=False, **STREAM_CASES["pinned"][0])
    batches: dict = {}
    c.save(batches=batches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not c.dry else [])
    try:
        for batch in s.batches:
            if c.left() < 10:
                batches[str(batch)] = {"skipped": f"{c.left():.0f} s left"}
                continue
            ids = prompts(s.vocab, batch, s.prompt).to(lm.torch_device)
            with torch.no_grad():
                lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                            do_sample=False, pad_token_id=0)  # warm: the schedule is recorded on the first forward
                cache = lm.new_cache()
                logits = lm.model(input_ids=ids, past_key_values=cache, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                device.synchronize()
                simulated: list = []
                with profile(activities=activities) as prof, \
                        (simulated_intervals(device, simulated) if c.dry else contextlib.nullcontext()):
                    for _ in range(2):
                        logits = lm.model(input_ids=token, past_key_values=cache, use_cache=True).logits
                        token = logits[:, -1:].argmax(-1)
                    device.synchronize()
            trace_path = c.scratch / f"trace-{batch}.json"
            prof.export_chrome_trace(str(trace_path))
            trace = json.loads(trace_path.read_text())
            if c.dry:
                result = {**summarize(simulated, unit_s=1.0), "source": "simulated device (copy landings, compute's operations)"}
            else:
                result = {**summarize(intervals_from_trace(trace)), "source": "torch.profiler (CUDA)"}
            result["trace_events"] = len(trace.get("traceEvents", [])) if isinstance(trace, dict) else len(trace)
            batches[str(batch)] = result
            if batch == s.batches[0]:
                with gzip.open(c.out / "gpu_quick_trace.json.gz", "wt") as f:
                    json.dump(trace, f)
            c.save(batches=batches)
        if not c.dry and all(r.get("copies", 0) == 0 for r in batches.values() if "skipped" not in r):
            c.save(note="no host-to-device copies in the trace: the profiler saw no CUDA activity (CUPTI unavailable?)")
    finally:
        lm.close()


STEP_FUNCTIONS = {"machine": step_machine, "copy": step_copy, "matmul": step_matmul, "folder": step_folder,
                  "profile": step_profile}


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_quick_out"), help="where the report goes (made if missing)")
    parser.add_argument("--dry-run", action="store_true", help="every step on the simulated device, tiny shapes (no GPU needed)")
    parser.add_argument("--budget-s", type=int, default=None, help="seconds for all the steps (default: 480; a dry run 150)")
    parser.add_argument("--scratch", default=None, help="where the model folder goes (default: /var/tmp, /tmp or build/, not tmpfs)")
    parser.add_argument("--steps", type=lambda text: text.split(","), default=None,
                        help=f"only these steps (default: all): {','.join(step.name for step in STEPS)}")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps:
        unknown = [name for name in args.steps if name not in {step.name for step in STEPS}]
        if unknown:
            parser.error(f"unknown step {unknown[0]!r}: choose from {', '.join(step.name for step in STEPS)}")
    if args.budget_s is None:
        args.budget_s = 150 if args.dry_run else 480
    args.out = args.out.resolve()
    if args.child is None:
        args.scratch = pick_scratch(args.scratch) if not args.dry_run or args.scratch else None
    else:
        args.scratch = Path(args.scratch)
    return args


def main() -> int:
    args = parse_args()
    if args.child is not None:
        return run_child(args.child, args)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            say(f"error: no CUDA device visible to torch {torch.__version__}: run with --dry-run here")
            return 2
    if args.scratch is None:  # a dry run's tiny folder: gone afterwards, so that --out holds the report alone
        with tempfile.TemporaryDirectory(prefix="gpu-quick-dry-") as scratch:
            args.scratch = Path(scratch)
            return Parent(args).run()
    return Parent(args).run()


if __name__ == "__main__":
    sys.exit(main())
