"""Files named by a user, checked before they are read: one line for every way a path can fail."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from attn_ledger.errors import AttnLedgerError, InputError, shown_path


def input_file(path: str | os.PathLike[str], field: str, cls: type[AttnLedgerError] = InputError) -> Path:
    """The path of an existing, readable regular file, or one line saying why not.

    A directory on the way that cannot be searched, a path that is not a regular file, a file
    that cannot be read: each is ``cls`` naming ``field`` and the path, never an ``OSError``.
    """
    text = os.fspath(path)
    if text.strip() == "":
        raise cls(f"{field}: got '', expected a file path")
    p = Path(text)
    try:
        st = p.stat()
    except OSError as exc:
        raise cls(f"{field}: got {shown_path(text)}, expected an existing, readable file ({_why(exc)})") from None
    import stat

    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise cls(f"{field}: got {shown_path(text)}, expected a file ({kind})")
    if not os.access(p, os.R_OK):
        raise cls(f"{field}: got {shown_path(text)}, expected a readable file (permission denied)")
    return p


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "file not found"
    if exc.errno == errno.EACCES:
        return "a directory on its path cannot be searched: permission denied"
    if exc.errno == errno.ENOTDIR:
        return "a part of its path is not a directory"
    return exc.strerror or type(exc).__name__
