"""Running the command line inside the test process, and checking its one-line errors."""

from __future__ import annotations

import sys
from collections import namedtuple

import pytest

from zerolite.cli import main as cli

Result = namedtuple("Result", "code stdout stderr")


def run(capsys, monkeypatch, *args: str) -> Result:
    """Runs the command line in this process (importing torch once, not once per case)."""
    monkeypatch.setattr(sys, "argv", ["zerolite", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out, err = capsys.readouterr()
    return Result(exit_info.value.code, out, err)


PLAN_LINES = ("plan: ", "K/V cache: ", "bound: ", "batch size: ")


def assert_one_line_error(result: Result, *fragments: str, after_plan: bool = False) -> None:
    """after_plan: the error struck once the run had started, so the plan printed before it may precede it."""
    assert result.code not in (0, None), result
    lines = result.stderr.strip().splitlines()
    if after_plan:
        lines = [line for line in lines if not line.startswith(PLAN_LINES)]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("zerolite: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
