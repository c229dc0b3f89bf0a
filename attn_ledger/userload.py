"""Import a user's attention function or module factory from ``file.py:NAME`` or ``pkg.mod:NAME``.

A user's file runs only because the user named it on the command line.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from attn_ledger.errors import SetupError


def load_object(spec: str, field: str = "target") -> Any:
    """Resolve ``path/to/file.py:NAME`` or ``package.module:NAME`` to the named object.

    Raises:
        SetupError: malformed spec, file missing, import failure, or name absent.
    """
    if ":" not in spec or spec.endswith(":") or spec.startswith(":"):
        raise SetupError(f"{field}: got {spec!r}, expected 'path/to/file.py:NAME' or 'package.module:NAME'")
    source, name = spec.rsplit(":", 1)
    if source.endswith(".py") or "/" in source or "\\" in source:
        path = Path(source)
        if not path.is_file():
            raise SetupError(f"{field}: file not found: {source!r}")
        mod_name = f"_attn_ledger_user_{abs(hash(str(path.resolve())))}"
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise SetupError(f"{field}: cannot import {source!r} as a Python file")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module
        parent = str(path.resolve().parent)
        added = parent not in sys.path
        if added:
            sys.path.insert(0, parent)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise SetupError(f"{field}: importing {source!r} raised {type(exc).__name__}: {_first_line(exc)}") from None
        finally:
            if added:
                sys.path.remove(parent)
    else:
        try:
            module = importlib.import_module(source)
        except Exception as exc:
            raise SetupError(f"{field}: cannot import module {source!r}: {type(exc).__name__}: {_first_line(exc)}") from None
    if not hasattr(module, name):
        raise SetupError(f"{field}: {source!r} has no attribute {name!r}")
    obj = getattr(module, name)
    if not callable(obj):
        raise SetupError(f"{field}: {spec!r} is a {type(obj).__name__}, expected a callable")
    return obj


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
