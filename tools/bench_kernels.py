"""The CPU matmul kernels an int4, int8 or bf16 layer can run, timed at the shapes of real layers
and row counts from decode to prefill, beside the memory-bandwidth bound.

    python tools/bench_kernels.py [--rows 1,16,64,512] [--shapes smollm2,7b,bench] [--threads 2] [--json out.json]
                                  [--cpu-time]

Kernels, all given bf16 rows: torch's int4 (aten._weight_int4pack_mm_for_cpu), int4 dequantised
by torch's tensor ops then a bf16 matmul (zerolite's prefill path before its own kernels), torch's
int8 (aten._weight_int8pack_mm), bf16 (F.linear), and zerolite's own int4, int8 and bf16 kernels
(zerolite.quant.cpu_kernels: the best path the CPU runs for bf16 rows, or ZEROLITE_CPU_KERNEL's)
and its int4 prefill path (its one-pass dequantisation into W^T, then torch's bf16 matmul). int4
in groups of 32, int8 per output channel. Shapes: SmolLM2-135M's, Llama-2-7B's, and tools/bench.py's
model's (its head included).

With --cpu-time (and --threads 1: the kernels then run on the calling thread) a call's time is
the CPU time of the calling thread, not the wall clock: on a machine other processes keep busy, the
kernels' own cost, though the memory's bandwidth is still shared.

Weights are read cold: each call takes the next of as many copies of the weight as fill
COLD_BYTES, more than the last-level cache, so every call reads its weight from memory as a
decode step of a model larger than the cache does (with --hot, the same copy every call). The
bound per call is the weight's bytes over the copy rate measured here (bytes read and written
by copying a buffer of COLD_BYTES, over the time); GB/s is the weight's bytes over a call's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerolite  # noqa: E402,F401  (first: torch's threads then wait as they do under zerolite, zerolite.openmp)

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from zerolite.quant import cpu_kernels  # noqa: E402
from zerolite.quant.linear import dequantize_int4  # noqa: E402
from zerolite.quant.quantize import SCALE_ZERO_SUFFIX, WeightScheme, quantize_int8  # noqa: E402

SHAPES = {  # (out, in) of a layer's projections
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536)],   # SmolLM2-135M: q/o, k/v, gate/up, down
    "7b": [(4096, 4096), (11008, 4096), (4096, 11008)],              # Llama-2-7B: q/k/v/o, gate/up, down
    "bench": [(2048, 2048), (5632, 2048), (2048, 5632), (32000, 2048)],  # tools/bench.py: q/k/v/o, gate/up, down, head
}
GROUP_SIZE = 32
COLD_BYTES = 1 << 30
MIN_SECONDS, MIN_CALLS = 0.3, 5


def copy_rate(nbytes: int = COLD_BYTES) -> float:
    """Bytes read plus bytes written per second by a copy of nbytes (the best of a few)."""
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def timed(call, copies: int, clock=time.perf_counter) -> float:
    """The median seconds of a call by clock, each on the next copy of its weights."""
    times, index, began = [], 0, time.perf_counter()
    call(0)  # warm: first-touch, lazy initialisation
    while len(times) < MIN_CALLS or time.perf_counter() - began < MIN_SECONDS:
        index = (index + 1) % copies
        start = clock()
        call(index)
        times.append(clock() - start)
    return statistics.median(times)


def formats(out: int, inp: int, hot: bool):
    """{kernel: (weight bytes, copies, call(index, x_bf16))} for one layer shape."""
    weight = torch.randn(out, inp, dtype=torch.bfloat16) / inp ** 0.5
    scheme = WeightScheme.parse("int4", GROUP_SIZE)
    int4 = scheme.quantize(weight)
    packed, scale_zero = int4[""], int4[SCALE_ZERO_SUFFIX]
    torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        dequantize_codes(packed, out, inp, scheme), GROUP_SIZE)
    q8, scale8 = quantize_int8(weight)
    int4_bytes = packed.nbytes + scale_zero.nbytes
    int8_bytes = q8.nbytes + scale8.nbytes

    def copies_of(tensors, nbytes):
        count = 1 if hot else max(1, COLD_BYTES // nbytes)
        return [tuple(t.clone() for t in tensors) for _ in range(count)]

    bf16 = copies_of((weight,), weight.nbytes)
    t4 = copies_of((torch_packed, scale_zero), int4_bytes)
    z4 = copies_of((packed, scale_zero), int4_bytes)
    z8 = copies_of((q8, scale8), int8_bytes)
    transposed = torch.empty((inp, out), dtype=torch.bfloat16)  # the prefill's scratch buffer, kept

    def zerolite_dequantised(i, x):
        cpu_kernels.int4_dequantize_transposed(transposed, z4[i][0], z4[i][1], GROUP_SIZE, scheme.packing)
        return torch.matmul(x, transposed)
    return {
        "torch-bf16": (weight.nbytes, len(bf16), lambda i, x: F.linear(x, bf16[i][0])),
        "torch-int4": (int4_bytes, len(t4), lambda i, x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, t4[i][0], GROUP_SIZE, t4[i][1])),
        "torch-int4-dequantised": (int4_bytes, len(z4), lambda i, x: F.linear(
            x, dequantize_int4(z4[i][0], z4[i][1], GROUP_SIZE, scheme.packing, torch.bfloat16))),
        "torch-int8": (int8_bytes, len(z8), lambda i, x: torch.ops.aten._weight_int8pack_mm(x, z8[i][0], z8[i][1])),
        "zerolite-int4": (int4_bytes, len(z4), lambda i, x: cpu_kernels.int4_matmul(
            x, z4[i][0], z4[i][1], out, GROUP_SIZE, scheme.packing)),
        "zerolite-int4-dequantised": (int4_bytes, len(z4), zerolite_dequantised),
        "zerolite-int8": (int8_bytes, len(z8), lambda i, x: cpu_kernels.int8_matmul(x, z8[i][0], z8[i][1])),
        "zerolite-bf16": (weight.nbytes, len(bf16), lambda i, x: cpu_kernels.bf16_matmul(x, bf16[i][0])),
    }


def dequantize_codes(packed, out, inp, scheme):
    """The int4 codes as torch's packer takes them (int32 [out, in])."""
    from zerolite.quant.int4_packing import unpack_int4
    return unpack_int4(packed, out, inp, scheme.packing).to(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--shapes", default="smollm2,7b")
    parser.add_argument("--kernels", default=None, help="comma-separated, default all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hot", action="store_true", help="the same copy of the weight every call")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu-time", action="store_true", help="time calls by the calling thread's CPU time")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    rate = copy_rate()
    cpu = cpu_name()
    kernel_path = os.environ.get(cpu_kernels.PATH_VARIABLE) or cpu_kernels.supported_paths()[-1]
    print(f"{cpu}; {args.threads} threads; zerolite kernel path {kernel_path}; "
          f"copy rate {rate / 1e9:.1f} GB/s (read + write); weights {'hot' if args.hot else 'cold'}; "
          f"{'CPU time of the calling thread' if args.cpu_time else 'wall clock'}")
    print(f"{'shape':>12} {'rows':>5} {'kernel':>24} {'ms':>9} {'GB/s':>7} {'bound ms':>9} {'x bound':>8}")
    results = []
    for shape_set in args.shapes.split(","):
        for out, inp in SHAPES[shape_set]:
            kernels = formats(out, inp, args.hot)
            for rows in rows_list:
                x = torch.randn(rows, inp, dtype=torch.bfloat16)
                for name, (nbytes, copies, call) in kernels.items():
                    if args.kernels and name not in args.kernels.split(","):
                        continue
                    seconds = timed(lambda i, call=call, x=x: call(i, x), copies, clock)
                    bound = nbytes / rate
                    results.append(dict(shape=[out, inp], rows=rows, kernel=name, ms=seconds * 1e3,
                                        gbps=nbytes / seconds / 1e9, bound_ms=bound * 1e3))
                    print(f"{out:>5}x{inp:<6} {rows:>5} {name:>24} {seconds * 1e3:>9.3f} "
                          f"{nbytes / seconds / 1e9:>7.1f} {bound * 1e3:>9.3f} {seconds / bound:>8.2f}", flush=True)
            del kernels
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu, threads=args.threads, copy_gbps=rate / 1e9,
                                                   hot=args.hot, cpu_time=args.cpu_time, results=results), indent=1))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
