"""Whether other work took this machine's processors while a probe ran, so that a probe timed on a
busy machine is not kept as the machine's own figure.

    with Contention() as load:
        rates = probe_compute(device, dtype)
    load.quiet            # False: other processes (or the hypervisor: steal) ran on the cores the probe needed
    quiet_now()           # the same, over a short wait now

Counted from /proc/stat over the probe: every CPU's busy time, less this process's own CPU time, is
what others took; it counts against the probe once it is more than the CPUs the probe left free
(the CPUs less torch's threads) by QUIET_CORES. A probe's threads share each op's work evenly, so
one core shared halves the op's speed: a matmul probe timed while other helpers ran took 18x its
quiet time. Neither simpler sign serves: this process's CPU time below wall x threads also holds a
probe's own one-thread stretches (a tiny model's layer probe is mostly Python, on one core of an
idle machine), and /proc/loadavg is a minute's average that counts the probe's own threads and
lags a load that has just begun or ended. Where /proc/stat cannot be read (not Linux), a probe
counts as quiet, as it did before there was a check.
"""

from __future__ import annotations

import os
import time

import torch

QUIET_CORES = 0.25      # others' use of the cores a probe needs, in cores, that still leaves its figures the machine's
QUIET_SAMPLE_S = 0.1    # how long quiet_now watches: ten ticks of /proc/stat on each CPU


def cpu_seconds() -> tuple[float, int] | None:
    """(seconds every CPU has been busy since boot, the CPUs counted) from /proc/stat; None where
    it cannot be read. Busy: user, nice, system, irq, softirq and steal (a guest's time is within
    user and nice already)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        ticks = [int(v) for v in lines[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy / os.sysconf("SC_CLK_TCK"), cpus


class Contention:
    """Others' use of the processors over a stretch of this process's work (a with block)."""

    def __enter__(self) -> Contention:
        self._start = (cpu_seconds(), time.process_time(), time.perf_counter())
        self._end = None
        return self

    def __exit__(self, *exc) -> None:
        self._end = (cpu_seconds(), time.process_time(), time.perf_counter())

    @property
    def others_cores(self) -> float | None:
        """The cores other work kept busy on average, None where /proc/stat could not say."""
        (before, own_before, started), (after, own_after, ended) = self._start, self._end
        if before is None or after is None or ended <= started:
            return None
        others = (after[0] - before[0]) - (own_after - own_before)
        return max(others, 0.0) / (ended - started)

    @property
    def quiet(self) -> bool:
        others = self.others_cores
        if others is None:
            return True
        spare = max(self._start[0][1] - torch.get_num_threads(), 0)
        return others <= spare + QUIET_CORES


def quiet_now() -> bool:
    """Whether others leave the cores free now: watched over QUIET_SAMPLE_S while this process waits."""
    with Contention() as load:
        time.sleep(QUIET_SAMPLE_S)
    return load.quiet
