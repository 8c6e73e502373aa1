"""The one exception type users see.

Every bad input (cluster spec, plan, config, checkpoint, data) raises `CephaloError` with a
message that says what is wrong and what to do. The CLI prints it on one line and exits 2;
library users can catch it. Anything else escaping is a bug.
"""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none): what a
    one-line error message quotes of a library's error."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class CephaloError(Exception):
    """A user-facing error: the message says what is wrong and what to do about it."""


class PlanDoesNotFit(CephaloError):
    """No plan fits every rank's memory. `shortfall_bytes` maps rank -> missing bytes."""

    def __init__(self, message: str, shortfall_bytes: dict[int, int] | None = None):
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes or {}


class MemoryBudgetExceeded(CephaloError):
    """A rank allocated past its memory budget (raised by the memory ledger)."""

    def __init__(self, message: str, rank: int, category: str):
        super().__init__(message)
        self.rank = rank
        self.category = category
