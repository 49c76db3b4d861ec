"""The shared shell of every `python -m andrea.<tool>` entry point.

`run_cli(main, argv)` turns the errors a user can fix into one line on stderr instead of a
traceback: `UserError` -> `error: <message>`, exit 2; Ctrl-C -> `interrupted`, exit 130 (the
shell's convention for SIGINT). With `--debug` among the arguments both propagate unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from andrea.errors import UserError


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Call `main(argv)` (default: sys.argv[1:]) and exit with its return code (None means 0)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        code = main(args)
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
