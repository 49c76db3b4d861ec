"""The one error type the command-line tools turn into a one-line message and exit code 2.

Library code raises `UserError` (a `ValueError`) for anything the user can fix: a bad config,
a bad file, a bad id. The entry points catch it, print `error: <message>` and exit 2; `--debug`
shows the traceback instead.
"""


class UserError(ValueError):
    """A mistake in the user's input, with a message that says what to fix."""
