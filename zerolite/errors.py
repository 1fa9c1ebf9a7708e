"""The one exception type for problems a user can fix: its message says what is wrong and how to fix it.

The command line prints it as a single line on stderr and exits non-zero; anything else that
escapes is a bug and gets a traceback only with --debug.
"""


def describe(error: BaseException) -> str:
    """An unexpected error on one line: its type and its message, whitespace folded."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


class ZeroliteError(Exception):
    """Bad input or a damaged file: `str(error)` is one line naming the problem and the fix.

    The line names the API's parameters as the library calls them, in backquotes
    (`max_new_tokens`); a front end words them as its own (the CLI: --max-new-tokens).
    """
