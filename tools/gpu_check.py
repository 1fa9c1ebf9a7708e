#!/usr/bin/env python3
"""The checks that need a CUDA machine, in one report to send back. Run as root (bench.py drops the page cache):

    make gpu-check TORCH=torch     # in a fresh clone: a CUDA build of torch, DeepSpeed, then this script
    python tools/gpu_check.py [--out gpu_check_report.md] [--batch-sizes 32,64] [--timeout 3600]

DeepSpeed's NVMe path also needs libaio (apt-get install libaio-dev).

1. the CUDA tests (`pytest -m cuda`) under TORCH_CUDA_SANITIZER=1, PyTorch's checker of
   unsynchronised accesses across CUDA streams: each on the real GPU and on the simulated device,
   among them what only a real GPU can show of the simulated device's findings (host memory
   registered through the driver in chunks, a refused registration leaving the next kernel
   working, every layer streamed and a mixture's experts copied apart, K/V fetched into compute's
   memory, resident quantized layers dequantised once, a self-draft's head as stored);
2. tools/bench.py at each batch size: zerolite --offload nvme and cpu, and nvme with int8 and int4
   weights, beside DeepSpeed ZeRO-Inference (NVMe and CPU), on the benchmark model (built and
   converted if missing);
3. `zerolite profile --offload nvme` on the same layout, at the first batch size;
4. tools/bench_serve.py on the same layout: zerolite serve with 1 client, then 16 at once.

Each step runs in its own process with a time limit; a step that fails or runs out of time is
reported as such and the others still run. The report is printed at the end and written to --out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench_contenders import CONTENDERS

ROOT = Path(__file__).resolve().parent.parent
ZEROLITE = shutil.which("zerolite", path=os.path.dirname(sys.executable)) or "zerolite"
DEFAULT_CONTENDERS = "zerolite-nvme,zerolite-cpu,zerolite-nvme-int8,zerolite-nvme-int4,deepspeed-nvme,deepspeed-cpu"
TAIL_LINES = 60
SANITIZER_FINDING = "CSAN detected a possible data race"


@dataclass
class Step:
    title: str
    command: list[str]
    returncode: int | None  # None: stopped at the time limit
    stdout: str
    stderr: str
    seconds: float

    @property
    def verdict(self) -> str:
        if self.returncode is None:
            return f"timed out after {self.seconds:.0f} s"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"


def run_step(title: str, command: list[str], timeout_s: int, env: dict[str, str] | None = None) -> Step:
    print(f"gpu_check: {title} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    # A session of its own, so that a timeout ends the step's children too (bench.py runs each
    # contender in a process of its own, which would otherwise hold the GPU through the next step).
    # Unbuffered, so that what a step printed before it was killed still reaches the report.
    try:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                   text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:  # the program is missing: the shell's exit status for that
        return Step(title, command, 127, "", str(e), time.perf_counter() - started)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        returncode = None
    return Step(title, command, returncode, stdout, stderr, time.perf_counter() - started)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def fenced(text: str) -> str:
    return f"```\n{text.rstrip() or '(no output)'}\n```"


def test_counts(output: str) -> str:
    """pytest's closing line ("2 passed, 1 failed, 310 deselected in 40.1s"), without the deselected."""
    for line in reversed(output.splitlines()):
        counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b", line)
        if counts and re.search(r" in [\d.]+s", line):
            return ", ".join(f"{n} {what}" for n, what in counts)
    return "no pytest summary line"


def sanitizer_findings(output: str) -> list[str]:
    """Each finding's first lines: the data pointer, then the two accesses' streams and kernels."""
    lines = output.splitlines()
    return ["\n".join(lines[i : i + 6]) for i, line in enumerate(lines) if SANITIZER_FINDING in line]


def tests_section(step: Step) -> str:
    output = step.stdout + step.stderr
    parts = [f"## CUDA tests under TORCH_CUDA_SANITIZER=1: {step.verdict}",
             f"`{' '.join(step.command)}` ({step.seconds:.0f} s): {test_counts(output)}"]
    if step.returncode == 5:
        parts.append("No test is marked cuda: pytest selected none.")
    findings = sanitizer_findings(output)
    parts.append(f"Sanitizer findings: {len(findings)}" + ("" if findings else " (none)"))
    parts += [fenced(finding) for finding in findings]
    if step.returncode != 0:
        parts += [f"Last {TAIL_LINES} lines of the output:", fenced(tail(output))]
    return "\n\n".join(parts)


def output_section(step: Step) -> str:
    """A bench or profile run: its printed report whole, and on failure the end of its stderr."""
    parts = [f"## {step.title}: {step.verdict}", f"`{' '.join(step.command)}` ({step.seconds:.0f} s)",
             fenced(step.stdout)]
    if step.returncode != 0:
        parts += [f"Last {TAIL_LINES} lines of stderr:", fenced(tail(step.stderr))]
    return "\n\n".join(parts)


def machine_line() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip() if shutil.which("git") else ""
    return (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"zerolite {commit or 'outside git'}, {time.strftime('%Y-%m-%d %H:%M %Z')}")


def whole_number(low: int, high: int):
    """An argparse type: a whole number from low to high."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low} to {high}")
        return value
    return parse


def batch_sizes(text: str) -> list[int]:
    return [whole_number(1, 4096)(part) for part in text.split(",")]


def contender_list(text: str) -> list[str]:
    unknown = [name for name in text.split(",") if name not in CONTENDERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown contender {unknown[0]!r}; known: {', '.join(CONTENDERS)}")
    return text.split(",")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.md"), help="where the report is written too")
    parser.add_argument("--source", type=Path, default=Path("build/llama19/source"),
                        help="the benchmark model (built if missing)")
    parser.add_argument("--layout", type=Path, default=Path("build/llama19/layout"),
                        help="its layout (converted if missing)")
    parser.add_argument("--batch-sizes", type=batch_sizes, default="32,64", help="one bench run each (default: 32,64)")
    parser.add_argument("--new-tokens", type=whole_number(2, 4096), default="16",
                        help="for tools/bench.py (default: 16)")
    parser.add_argument("--contenders", type=contender_list, default=DEFAULT_CONTENDERS,
                        help=f"for tools/bench.py (default: {DEFAULT_CONTENDERS})")
    parser.add_argument("--timeout", type=whole_number(60, 86400), default="3600",
                        help="seconds one step may take (default: 3600)")
    args = parser.parse_args()
    if not args.out.resolve().parent.is_dir():
        parser.error(f"cannot write {args.out}: folder {args.out.resolve().parent} does not exist")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        sys.exit(f"gpu_check: error: no CUDA device visible to torch {torch.__version__} ({build}): "
                 "run it on a machine with an NVIDIA GPU and a CUDA build of torch "
                 "(make gpu-check TORCH=torch in a fresh clone)")
    source, layout = args.source.resolve(), args.layout.resolve()  # the steps run from the repository root

    # The report is written again after each step, so that what ran survives a kill of the whole check.
    header = f"# zerolite GPU check\n\n{machine_line()}"
    sections: list[str] = []

    def report(section: str) -> str:
        sections.append(section)
        text = "\n\n".join([header, *sections]) + "\n"
        args.out.write_text(text)
        return text

    tests = run_step("CUDA tests", [sys.executable, "-m", "pytest", "-m", "cuda", "-q"], args.timeout,
                     env={"TORCH_CUDA_SANITIZER": "1"})
    report(tests_section(tests))
    benches = []
    for batch in args.batch_sizes:
        # bench.py's own limit per contender leaves it time to print its table if one of them hangs.
        per_contender = args.timeout // (len(args.contenders) + 1)
        command = [sys.executable, str(ROOT / "tools" / "bench.py"), "--make-model", "--source", str(source),
                   "--layout", str(layout), "--device", "cuda", "--batch-size", str(batch),
                   "--new-tokens", str(args.new_tokens), "--contenders", ",".join(args.contenders),
                   "--timeout", str(per_contender)]
        benches.append(run_step(f"tools/bench.py, batch {batch}", command, args.timeout))
        report(output_section(benches[-1]))
    profile = run_step("zerolite profile",
                       [ZEROLITE, "profile", "--model", str(layout), "--offload", "nvme", "--device",
                                            "cuda", "--batch-size", str(args.batch_sizes[0])], args.timeout)
    report(output_section(profile))
    serve = run_step("tools/bench_serve.py",
                     [sys.executable, str(ROOT / "tools" / "bench_serve.py"), "--model", str(layout),
                                              "--device", "cuda", "--clients", "16"], args.timeout)
    print(report(output_section(serve)))
    steps = [tests, *benches, profile, serve]
    failed = [step.title for step in steps if step.returncode != 0]
    print(f"gpu_check: report written to {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""),
          file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
