"""Running the command line and the tools inside the test process, and checking one-line errors."""

from __future__ import annotations

import importlib
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from zerolite.cli import main as cli

Result = namedtuple("Result", "code stdout stderr")
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def run(capsys, monkeypatch, *args: str) -> Result:
    """Runs the command line in this process (importing torch once, not once per case)."""
    monkeypatch.setattr(sys, "argv", ["zerolite", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out, err = capsys.readouterr()
    return Result(exit_info.value.code, out, err)


def run_tool(capsys, monkeypatch, name: str, *args: str) -> Result:
    """tools/NAME.py run in this process as `python tools/NAME.py ARGS` runs it: its exit code,
    with sys.exit("message")'s message on stderr as the interpreter would print it."""
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *map(str, args)])
    code = 0
    try:
        importlib.import_module(name).main()
    except SystemExit as exit:
        code = exit.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    out, err = capsys.readouterr()
    return Result(code or 0, out, err)


PLAN_LINES = ("plan: ", "plan for ", "K/V cache: ", "bound: ", "batch size: ")


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
