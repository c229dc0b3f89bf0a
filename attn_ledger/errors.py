"""The one error family attn-ledger raises for things a user can fix.

The CLI turns every :class:`AttnLedgerError` into a single line on stderr and exit
status 2. Checks never raise these: a failed invariant is a result, not an error.
"""

from __future__ import annotations


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


def field_error(field: str, value: object, expected: str, cls: type[InputError] = InputError) -> InputError:
    """Build the standard one-line message: the field, the value received and what was expected."""
    return cls(f"{field}: got {value!r}, expected {expected}")
