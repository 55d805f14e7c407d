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


def refuses_one_sample(e: BaseException) -> bool:
    """Whether ``e`` is BatchNorm's refusal, in train mode, of a single value per channel
    (``ValueError: Expected more than 1 value per channel when training``): a micro-batch of one
    sample over ``[1, C]`` features or feature maps pooled to 1 x 1 (ResNet-50 at 32 pixels).
    Also what ``torch.compile`` raises around it, which keeps torch's message."""
    return "Expected more than 1 value per channel" in str(e)


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop (loading, planning, the final evaluation, writing the
    model): it stops as Ctrl-C does, cleaning up what was being written, and the command's exit
    code says which signal it was (143, not Ctrl-C's 130)."""


def signal_exit_code(name: str | None) -> int:
    """The exit code of a command stopped by the signal ``name`` (``"SIGINT"``, ``"SIGTERM"``):
    128 plus its number, as a shell reports a process ended by that signal (130 for Ctrl-C, 143
    for SIGTERM), so that a scheduler or script reads how the run ended; 130 for an unknown name."""
    import signal

    try:
        return 128 + int(signal.Signals[name])
    except (KeyError, TypeError):
        return 130
