"""Errors tightfit raises for problems the user can fix (bad input, impossible budgets)."""


class TightfitError(Exception):
    """A user-facing error: the command line prints its message on one line and exits with 2.

    Raised for bad input (missing or malformed files, unknown columns or GPU profiles,
    unparseable sizes) and for requests that cannot be met (a memory budget below what
    the model's weights and optimizer state need, a micro-batch of 1 that still does
    not fit). Never raised for bugs: those propagate as their own exception types.
    """


def error_line(e: BaseException) -> str:
    """An error in one reason line: its type and the first line of its message (at most 200 characters)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
