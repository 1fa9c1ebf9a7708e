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
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
_set_by_zerolite = False


def prefer_passive_waits() -> None:
    global _set_by_zerolite
    if WAIT_POLICY not in os.environ and "torch" not in sys.modules:
        os.environ[WAIT_POLICY] = "PASSIVE"
        _set_by_zerolite = True


def threads_may_spin() -> bool:
    """True when torch's threads spin while they wait: torch loaded before zerolite could set the
    policy and no one else set it, or the user asked for active waits. (zerolite never sets the
    policy once torch is loaded, so the environment says what libgomp read.)"""
    return os.environ.get(WAIT_POLICY, "").upper() != "PASSIVE"


def environment_as_the_user_had_it() -> dict[str, str]:
    """os.environ without what zerolite set for torch (this policy, zerolite.huge_pages'): for
    running other programs as the user would."""
    from zerolite import huge_pages

    env = dict(os.environ)
    if _set_by_zerolite:
        env.pop(WAIT_POLICY, None)
    if huge_pages.set_by_zerolite():
        env.pop(huge_pages.HUGE_PAGES, None)
    return env
