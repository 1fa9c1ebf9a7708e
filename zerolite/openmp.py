"""How torch's compute threads wait, set before torch starts them.

By default OpenMP's threads spin for a while after each parallel region, waiting for the next one.
A decode step runs hundreds of short regions, so on a machine with few cores they spin nearly all
the time, and the I/O engine's threads, which finish the reads the next layers need, get no core:
a streamed step then takes many times what its reads alone would. Threads that sleep while they
wait cost a little compute where nothing is streamed, and keep a streamed step near its reads' time.

libgomp reads OMP_WAIT_POLICY once, when torch loads it, so zerolite sets it on import, before
torch, unless the user chose a policy; a program that imported torch first keeps torch's threads as
they are, which threads_may_spin() tells (zerolite profile says so).
"""

from __future__ import annotations

import os

from zerolite.torch_env import set_before_torch

WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_passive_waits() -> None:
    set_before_torch(WAIT_POLICY, "PASSIVE")


def threads_may_spin() -> bool:
    """True when torch's threads spin while they wait: torch loaded before zerolite could set the
    policy and no one else set it, or the user asked for active waits. (zerolite never sets the
    policy once torch is loaded, so the environment says what libgomp read.)"""
    return os.environ.get(WAIT_POLICY, "").upper() != "PASSIVE"
