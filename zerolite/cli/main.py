"""The `zerolite` command's entry point: every command registered, and every problem a user can
fix ended as one line on stderr with a non-zero exit; --debug adds the traceback.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.exceptions import TyperException

from zerolite.cli import (  # noqa: F401 (each registers its commands with app)
    convert_commands,
    generate_command,
    plan_command,
    profile_command,
    serve_command,
)
from zerolite.cli.app import app
from zerolite.cli.options import flag_words
from zerolite.distributed.world import RankFailed
from zerolite.errors import ZeroliteError, describe


def main() -> None:
    # transformers draws raw tqdm bars (GGUF dequantization) that no logging switch silences; tqdm
    # reads this when it is first imported, which the lazy imports in the commands come after.
    os.environ.setdefault("TQDM_DISABLE", "1")
    argv = sys.argv[1:]
    debug = "--debug" in argv
    try:
        code = app(args=[a for a in argv if a != "--debug"], standalone_mode=False)
    except RankFailed as e:  # every rank raised it; rank 0 says it
        if e.printer:
            print(f"zerolite: error: {flag_words(str(e))}", file=sys.stderr, flush=True)
        e.part_ways()
        sys.exit(1)
    except ZeroliteError as e:
        fail(flag_words(str(e)), debug)
    except TyperException as e:  # usage errors: a missing argument, a bad option value
        fail(f"{e.format_message()} (see zerolite --help)", debug, code=2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        fail("interrupted", debug, code=130)
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        fail(f"internal error: {describe(e)} (rerun with --debug for the traceback)", debug)
    sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, debug: bool, code: int = 1) -> None:
    if debug:
        import traceback

        traceback.print_exc()
    print(f"zerolite: error: {message}", file=sys.stderr)
    sys.exit(code)
