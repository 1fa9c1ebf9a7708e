"""How torch's compute threads wait, set before torch starts them.

By default OpenMP's threads spin for a while after each parallel region, waiting for the next one.
A decode step runs hundreds of short regions, so on a machine with few cores they spin nearly all
the time, and the I/O engine's threads, which finish the reads the next layers need, get no core:
on the 2-core test machines, an int4 layer stream took 2.1 s per step with spinning threads
against 0.20 s with waiting ones (the read-only pass took 0.23 s). Threads that go to sleep at
once cost the next region a wake-up instead: a small model in RAM ran at half speed (25.5 against
50.6 ms per token). So they spin briefly, then sleep: GOMP_SPINCOUNT=10000 with
OMP_WAIT_POLICY=PASSIVE (libgomp spins that many times before sleeping; other OpenMP runtimes
read only the policy). Over tools/bench, 3 runs each, that was 10-25% faster than PASSIVE alone
in every case measured, streamed or in RAM, at batch 1 and 16.

libgomp reads these once, when torch loads it, so zerolite sets them on import, before torch,
unless the user chose either; a program that imported torch first keeps torch's threads as they
are, which threads_may_spin() tells (zerolite profile says so).
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
WAITING = {WAIT_POLICY: "PASSIVE", SPIN_COUNT: "10000"}
_set_by_zerolite = False


def prefer_passive_waits() -> None:
    global _set_by_zerolite
    if not any(name in os.environ for name in WAITING) and "torch" not in sys.modules:
        os.environ.update(WAITING)
        _set_by_zerolite = True


def threads_may_spin() -> bool:
    """True when torch's threads spin while they wait: torch loaded before zerolite could set the
    policy and no one else set it, or the user asked for active waits. (zerolite never sets the
    policy once torch is loaded, so the environment says what libgomp read.)"""
    return os.environ.get(WAIT_POLICY, "").upper() != "PASSIVE"


def environment_as_the_user_had_it() -> dict[str, str]:
    """os.environ without what zerolite set: for running other programs as the user would."""
    env = dict(os.environ)
    if _set_by_zerolite:
        for name in WAITING:
            env.pop(name, None)
    return env
