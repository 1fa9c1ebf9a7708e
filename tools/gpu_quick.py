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
            safetensors, then planned in place (only a manifest written); the disk's own read rate;
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

This file runs the steps and keeps the report; the steps are in gpu_quick_steps.py (machine, copy,
matmul, folder) and gpu_quick_stream.py (stream-*, profile), the report's figures and markdown in
gpu_quick_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # on the GPU machine zerolite is not installed: the extension is built into ROOT/zerolite
    sys.path.insert(1, str(ROOT))

from gpu_quick_report import derive, headline, markdown, tests_summary  # noqa: E402  (siblings in tools/)
from gpu_quick_steps import (  # noqa: E402
    STREAM_CASES,
    Child,
    MiB,
    filesystem_type,
    shapes,
    step_copy,
    step_folder,
    step_machine,
    step_matmul,
    write_atomically,
)
from gpu_quick_stream import step_profile, stream_case  # noqa: E402


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
TESTS_SANITIZED_K = "(kv or tiers)"
HUNG_LIMIT_S = 45
# For the tests: a step that saves a figure and then hangs, and a cap on that step's limit (the others keep
# theirs, so that a busy machine's slow copy step is not taken for a hang).
HANG_VARIABLE, LIMIT_VARIABLE = "GPU_QUICK_HANG", "GPU_QUICK_LIMIT_S"
CUDA_TESTS_LEFT_OUT = {"test_serve.py"}  # needs uvicorn, which the GPU image lacks


def streams(step: str) -> bool:
    """Whether the step runs the model streamed (a hang in one predicts the others')."""
    return step.startswith("stream-") or step == "profile"


def now() -> str:
    return time.strftime("%H:%M:%S")


def say(text: str) -> None:
    print(f"gpu_quick {now()} {text}", file=sys.stderr, flush=True)


def cuda_test_files() -> list[str]:
    """The test modules with cuda-marked tests, less those that import what the GPU image lacks at
    collection (test_serve: uvicorn): collecting only these is faster, and a module that fails to
    import elsewhere cannot stop the run (--continue-on-collection-errors besides)."""
    return [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))
            if path.name not in CUDA_TESTS_LEFT_OUT and "mark.cuda" in path.read_text(errors="replace")]



def pytest_command(dry: bool, sanitized: bool) -> list[str]:
    """The cuda-marked tests, their real-device parameters only (a dry run: one cheap case's sim
    parameter, collected from its own module alone: collecting every cuda module took most of the step)."""
    options = ["-m", "cuda", "-v", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
               "--continue-on-collection-errors"]
    if dry:
        case = "kv_cache_partly" if sanitized else "registered_in_chunks"
        files = [f for f in cuda_test_files() if case in (ROOT / f).read_text(errors="replace")]
        return [sys.executable, "-m", "pytest", *files, *options, "-k", f"sim and {case}"]
    k = f"not sim and {TESTS_SANITIZED_K}" if sanitized else f"not sim and not {TESTS_SANITIZED_K}"
    workers = ["-n", "6"] if _has_module("xdist") else []
    return [sys.executable, "-m", "pytest", *cuda_test_files(), *options, "-k", k, *workers]


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
        if self.dry:
            ForkedStep.import_once()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.scratch / "results").mkdir(parents=True, exist_ok=True)
        for path in (self.log, self.tests_log):
            path.write_text("")
        chosen = [step for step in STEPS if self.args.steps is None or step.name in self.args.steps]
        say(f"{'dry run' if self.dry else 'GPU run'}: {len(chosen)} steps within {self.args.budget_s} s; "
            f"out {self.out}, scratch {self.scratch}")
        for i, step in enumerate(chosen):
            later_floor = sum(later.floor_s for later in chosen[i + 1:])
            left = self.deadline - time.time()
            limit = step.dry_limit_s if self.dry else step.limit_s
            if os.environ.get(HANG_VARIABLE) == step.name:
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
            # The disk case may run out of time on a slow disk alone; any other streaming step's timing out
            # is a hang.
            if (streams(step.name) and step.name != "stream-disk"
                    and self.report["steps"][step.name]["status"] == "timed out"):
                self.streaming_hung = True
        failed = [name for name, s in self.report["steps"].items() if s["status"] != "ok"]
        self.report["seconds"] = round(time.time() - self.started, 1)
        self.write()
        say(f"done in {self.report['seconds']} s; report {self.out / 'gpu_quick.md'}"
            + (f"; not ok: {', '.join(failed)}" if failed else ""))
        # The headline and the steps' verdicts (what a look at the end of the output should show); the
        # rest is in the files.
        text = (self.out / "gpu_quick.md").read_text()
        start, end = max(text.find("## Headline"), 0), text.find("## Machine")
        print(text[start:end if end > start else None].rstrip())
        return 1 if failed else 0

    def run_step(self, step: Step, timeout: int) -> None:
        say(f"{step.name}: started (limit {timeout} s)")
        tests = step.name.startswith("tests")
        # in a folder of its own: pytest's pruning of old runs in its default one never meets another pytest's
        if tests:
            command = [*pytest_command(self.dry, step.name == "tests-sanitized"), "--basetemp",
                       str(self.scratch / f"pytest-{step.name}")]
        else:
            command = [sys.executable, str(Path(__file__).resolve()), "--child", step.name, "--scratch",
                       str(self.scratch), "--out", str(self.out),
                       "--deadline", str(time.time() + timeout - 3)] + (["--dry-run"] if self.dry else [])
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
               "ZEROLITE_CACHE": str(self.scratch / "cache")}
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
                if self.dry:
                    process = ForkedStep(command, env, sink)
                else:
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
                    self.merge(step.name,
                               {k: v for k, v in json.loads(results.read_text()).items() if k != "traceback"})
                    self.write()

    def merge(self, name: str, data: dict) -> None:
        if name.startswith("stream-"):
            self.report["streaming"][name.removeprefix("stream-")] = data
        elif name.startswith("tests"):
            self.report["tests"][name] = data
        else:
            self.report[name] = data

    def write(self) -> None:
        """The JSON, then the markdown; a figure of a shape the report did not expect costs the
        markdown (it says why), never the run or the JSON."""
        try:
            derive(self.report)
        except Exception as e:
            self.report["derive_error"] = f"{type(e).__name__}: {e}"
        write_atomically(self.out / "gpu_quick.json", json.dumps(self.report, indent=1, default=str))
        try:
            text = markdown(self.report)
        except Exception as e:
            text = (f"# zerolite gpu_quick\n\n## Headline\n\n"
                    f"the markdown failed ({type(e).__name__}: {e}): see gpu_quick.json\n\n"
                    f"## Machine\n")
        write_atomically(self.out / "gpu_quick.md", text)


class ForkedStep:
    """A dry run's step: the process that `command` would start (this script's child, or pytest),
    forked from this one with what the steps import imported once (their import was most of each dry
    step's time). Its own session, output and environment, as Popen's; it parses `command` itself.
    A GPU run starts fresh interpreters: a fork must not inherit CUDA, and a fresh pytest picks
    OpenMP's waits as the user's environment says (zerolite, imported here first, chose them)."""

    def __init__(self, command: list[str], env: dict[str, str], sink):
        sys.stdout.flush()
        sys.stderr.flush()
        self.args, self.returncode = command, None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.setsid()
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(sink.fileno(), 1)
                os.dup2(sink.fileno(), 2)
                for stream in (sys.stdout, sys.stderr):
                    stream.reconfigure(write_through=True)  # as PYTHONUNBUFFERED=1 has a fresh interpreter's
                os.environ.clear()
                os.environ.update(env)
                os.chdir(ROOT)
                if command[1:3] == ["-m", "pytest"]:
                    import pytest

                    code = int(pytest.main(command[3:]))
                else:
                    sys.argv = command[1:]
                    code = main()
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    @staticmethod
    def import_once() -> None:
        """zerolite first (it sets OpenMP's waiting policy), then the simulated device (tests/support: it
        imports transformers' model code), zerolite's loading and the tiny Llama's modeling code."""
        import importlib

        sys.path.insert(0, str(ROOT / "tests"))
        for name in ("zerolite", "torch", "transformers", "support.simulated_device", "zerolite.lm.loading",
                     "zerolite.convert.resolve", "transformers.models.llama.modeling_llama"):
            importlib.import_module(name)

    def wait(self, timeout: float | None = None) -> int:
        """As Popen.wait: the exit status (minus the signal's number if one ended it), or TimeoutExpired."""
        until = None if timeout is None else time.perf_counter() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif until is not None and time.perf_counter() >= until:
                raise subprocess.TimeoutExpired(self.args, timeout)
            else:
                time.sleep(0.02)
        return self.returncode


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
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5)
        return done.stdout.strip() or None
    return None


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
        child.save(error=f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                   traceback=traceback.format_exc()[-3000:])
        traceback.print_exc()
        return 1


STEP_FUNCTIONS = {"machine": step_machine, "copy": step_copy, "matmul": step_matmul, "folder": step_folder,
                  "profile": step_profile}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_quick_out"),
                        help="where the report goes (made if missing)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the simulated device, tiny shapes (no GPU needed)")
    parser.add_argument("--budget-s", type=int, default=None,
                        help="seconds for all the steps (default: 480; a dry run 150)")
    parser.add_argument("--scratch", default=None,
                        help="where the model folder goes (default: /var/tmp, /tmp or build/, not tmpfs)")
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
