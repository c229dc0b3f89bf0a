"""The one error family attn-ledger raises for things a user can fix.

The CLI turns every :class:`AttnLedgerError` into a single line on stderr and exit
status 2. Checks never raise these: a failed invariant is a result, not an error.
"""

from __future__ import annotations

from typing import Iterable


class AttnLedgerError(Exception):
    """Base class: bad input, bad usage or a setup problem (exit status 2)."""


class InputError(AttnLedgerError):
    """A config value, tensor or file given by the user is not acceptable."""


class ConfigError(InputError):
    """A config file is unreadable, malformed, or holds an unknown or invalid key."""


class TensorFileError(InputError):
    """A tensor file is missing, unreadable, unsafe or holds the wrong tensors."""


class SetupError(AttnLedgerError):
    """A user's implementation cannot be imported, found or constructed."""


class ResourceError(AttnLedgerError):
    """The request needs more of a resource (memory) than the machine or the stated budget has."""

    def __init__(self, message: str, needed: int | None = None, available: int | None = None) -> None:
        super().__init__(message)
        self.needed, self.available = needed, available  # bytes: the estimate and the headroom


SHOWN_CHARS = 60  # an echoed value is cut to about this many characters
PATH_CHARS = 240  # a path is shown whole up to this length
FIRST_LINE_CHARS = 200  # an exception's message quoted in a finding: its first line, cut to this many characters


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, saying how long it was, so a line stays readable."""
    r = repr(value)
    if len(r) <= limit:
        return r
    length = f"{len(value)} characters" if isinstance(value, str) else f"{len(r)} characters as text"
    return f"{r[:limit]}... ({length})"


def shown_path(path: object) -> str:
    """A path as it is echoed in a message: quoted, and cut only when absurdly long."""
    return shown(str(path), PATH_CHARS)


def first_line(exc: BaseException, empty: str = "(no message)", limit: int | None = FIRST_LINE_CHARS) -> str:
    """The first line of ``exc``'s message cut to ``limit`` characters (None: whole), or ``empty`` when it has none.

    A first line that only introduces the next (``backend='inductor' raised:``) is joined to that line, which says
    what happened.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return empty
    line = lines[0] if not lines[0].endswith(":") or len(lines) == 1 else f"{lines[0]} {lines[1]}"
    return line[:limit]


def clip(text: str, limit: int = 120) -> str:
    """``text`` cut to about ``limit`` characters (for a library's message quoted in ours)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def field_error(field: str, value: object, expected: str, cls: type[InputError] = InputError) -> InputError:
    """Build the standard one-line message: the field, the value received (cut to a readable length)
    and what was expected."""
    return cls(f"{field}: got {shown(value)}, expected {expected}")


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """``"; did you mean 'causal'?"`` when one of ``choices`` is close to ``value`` (by difflib's ratio,
    at least 0.6), else ``""``: the tail of a message that refused ``value``."""
    import difflib

    if not isinstance(value, str) or not value:
        return ""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
