"""Running the command line inside the test process, and checking its one-line errors."""

from __future__ import annotations

import sys
from collections import namedtuple

import pytest

from zerolite import cli

Result = namedtuple("Result", "code stdout stderr")


def run(capsys, monkeypatch, *args: str) -> Result:
    """Runs the command line in this process (importing torch once, not once per case)."""
    monkeypatch.setattr(sys, "argv", ["zerolite", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out, err = capsys.readouterr()
    return Result(exit_info.value.code, out, err)


def assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.code not in (0, None), result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("zerolite: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
