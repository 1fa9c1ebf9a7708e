"""One rank of the tests' torchrun jobs, through the Python API (zerolite.load, zerolite.generate_file):

    torchrun --nproc-per-node 2 tests/rank_worker.py LAYOUT PROMPTS OUTPUT REPORT_DIR --device sim [--die-at-batch 2]

--device cpu, sim (each rank a simulated asynchronous device of its own, its ledger watching
the whole run) or cuda. --die-at-batch N: rank 1 kills itself with SIGKILL as its Nth batch starts.
Each rank writes REPORT_DIR/rank{RANK}.json: what it ran on and what it mapped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from contextlib import nullcontext
from pathlib import Path

import zerolite  # before torch: zerolite sets OpenMP's waiting policy
from support.simulated_device import SimulatedDevice  # tests/ is the script's folder, so on the path


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("layout", "prompts", "output", "reports"):
        parser.add_argument(name)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--offload", default="cpu")
    parser.add_argument("--die-at-batch", type=int)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    device = SimulatedDevice(seed=rank, memory_bytes=1 << 30) if args.device == "sim" else args.device
    with device.watching() if isinstance(device, SimulatedDevice) else nullcontext():
        lm = zerolite.load(args.layout, offload=args.offload, device=device, show_progress=False, gpu_memory=0)
        if args.die_at_batch is not None and rank == 1:
            die_at(lm, args.die_at_batch)
        zerolite.generate_file(lm, args.prompts, args.output, zerolite.Sampling(max_new_tokens=6), batch_size=2,
                               show_progress=False)
        report = {
            "device": lm.device.name if args.device != "cuda" else str(lm.torch_device),
            "adopted": getattr(device, "adopted", None),
            "host_copy": [line.split()[-3] for line in Path("/proc/self/maps").read_text().splitlines()
                          if "zerolite-host-copy" in line][:1],   # the shared memory's inode
        }
        lm.close()
    Path(args.reports, f"rank{rank}.json").write_text(json.dumps(report))


def die_at(lm, batch: int) -> None:
    """Rank 1 dies as its batch-th batch starts: SIGKILL, no cleanup, as the OOM killer would."""
    generate = lm.generate
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return generate(*args, **kwargs)

    lm.generate = dying


if __name__ == "__main__":
    main()
