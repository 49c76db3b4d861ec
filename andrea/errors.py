"""The one error type the command-line tools turn into a one-line message and exit code 2.

Library code raises `UserError` (a `ValueError`) for anything the user can fix: a bad config,
a bad file, a bad id. The entry points catch it, print `error: <message>` and exit 2; `--debug`
shows the traceback instead.

A registry (andrea.model.block.NORMS, andrea.run.schedule.SCHEDULES, andrea.run.sinks.SINKS) checks
the names it is given itself, with `check_key`: the config calls its check and never lists the members.
"""


class UserError(ValueError):
    """A mistake in the user's input, with a message that says what to fix."""


def one_of(values) -> str:
    """"a, b or c" ("a" alone) for values (a sequence, or a dict's keys)."""
    *rest, last = values
    return f"{', '.join(rest)} or {last}" if rest else last


def check_key(registry, value, key: str, note: str = "") -> None:
    """A UserError unless value is a name registry holds: "KEY must be a, b or c NOTE, got 'value'"."""
    if value not in registry:
        raise UserError(f"{key} must be {one_of(registry)}{note}, got {value!r}")
