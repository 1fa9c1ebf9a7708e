"""Environment variables zerolite sets for torch, which reads them once as it starts: set on
import, before torch loads, unless the user set them (zerolite.openmp's wait policy,
zerolite.huge_pages' large tensors); left out again for the other programs zerolite runs.
"""

from __future__ import annotations

import os
import sys

_set_by_zerolite: set[str] = set()


def set_before_torch(name: str, value: str) -> None:
    """name=value in the environment, unless the user set name or torch has loaded (then what it
    read stays as it was)."""
    if name not in os.environ and "torch" not in sys.modules:
        os.environ[name] = value
        _set_by_zerolite.add(name)


def environment_as_the_user_had_it() -> dict[str, str]:
    """os.environ without what zerolite set for torch: for running other programs as the user would."""
    return {name: value for name, value in os.environ.items() if name not in _set_by_zerolite}
