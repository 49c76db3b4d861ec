"""The shared shell of every `python -m andrea.<tool>` entry point.

`run_cli(main, argv)` turns the errors a user can fix into one line on stderr instead of a
traceback: `UserError` -> `error: <message>`, exit 2; Ctrl-C -> `interrupted`, exit 130 (the
shell's convention for SIGINT); a failure of the outside world that no caller handled (a full
disk, a vanished file) -> `error: <path>: <reason>`, exit 1. With `--debug` among the arguments
all three propagate unchanged. `ArgumentParser` reports a bad flag the same way: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from andrea.errors import UserError


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Call `main(argv)` (default: sys.argv[1:]) and exit with its return code (None means 0)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        _check_environment()
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
    except OSError as e:
        if debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e} (add --debug for the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)


def _check_environment():
    """Settings read deep inside the engine, checked before any work so a typo is one line."""
    from minitensor import parallel
    from minitensor.backends import numba_jit

    try:
        numba_jit.mode()
        parallel.num_threads()
    except ValueError as e:
        raise UserError(str(e)) from e


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line `error: ...` (exit 2) instead of the usage block, like every other error."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
