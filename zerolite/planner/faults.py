"""A fault of the planner's own, said in one line: a plan is advice, and no part of it (a probe that
raises on some machine, a cost that divides by zero on some config) may reach a user as an
internal error.

    with planner_part("measure the disk"):
        figures = measure_disk(folder)

A ZeroliteError passes as it is (it already says what to fix); anything else becomes one, naming the
part. generate then runs on its default budgets, saying so; zerolite plan says the line and stops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from zerolite.errors import ZeroliteError, describe


@contextmanager
def planner_part(what: str) -> Iterator[None]:
    try:
        yield
    except ZeroliteError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever any part raises, on any family or machine
        raise ZeroliteError(f"the planner could not {what}: {describe(e)}") from e
