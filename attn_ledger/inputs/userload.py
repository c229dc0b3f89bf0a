"""Import a user's attention function or module factory from ``file.py:NAME`` or ``pkg.mod:NAME``.

A user's file runs only because the user named it on the command line. The import is a
call into user code (:func:`attn_ledger.guard.user_call`): ``sys.exit`` at import time is a
:class:`SetupError`, and in a worker a hang or a crash there is reported by the parent.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_ledger.errors import SetupError
from attn_ledger.guard import outcome, user_call
from attn_ledger.inputs.paths import input_file


@dataclass(frozen=True)
class ObjectSpec:
    """A parsed ``source:NAME`` as written (``text``) for the option ``field``: ``source`` is a file's path, or an
    importable module's name."""

    source: Path | str
    text: str
    field: str
    name: str

    def importing(self) -> str:
        """What importing it is called in a finding: ``importing 'path/to/file.py'``."""
        return f"importing {str(self.source)!r}"


def parse_spec(spec: str, field: str = "target") -> ObjectSpec:
    """Check the form of ``path/to/file.py:NAME`` or ``package.module:NAME`` without importing anything.

    Raises:
        SetupError: malformed spec, or the file is missing.
    """
    if ":" not in spec or spec.endswith(":") or spec.startswith(":"):
        raise SetupError(f"{field}: got {spec!r}, expected 'path/to/file.py:NAME' or 'package.module:NAME'")
    source, name = spec.rsplit(":", 1)
    if source.endswith(".py") or "/" in source or "\\" in source:
        path = input_file(source, field, SetupError)  # missing, a directory, or behind an unsearchable one: one line
        return ObjectSpec(path, spec, field, name)
    return ObjectSpec(source, spec, field, name)


def load_object(spec: str, field: str = "target") -> Any:
    """Resolve ``path/to/file.py:NAME`` or ``package.module:NAME`` to the named object.

    Raises:
        SetupError: malformed spec, file missing, import failure (a raise or ``sys.exit``
            while importing), or name absent.
    """
    parsed = parse_spec(spec, field)
    module = _import_file(parsed, parsed.source) if isinstance(parsed.source, Path) else _import_module(parsed)
    if not hasattr(module, parsed.name):
        raise SetupError(f"{field}: {str(parsed.source)!r} has no attribute {parsed.name!r}")
    obj = getattr(module, parsed.name)
    if not callable(obj):
        raise SetupError(f"{field}: {spec!r} is a {type(obj).__name__}, expected a callable")
    return obj


def _import_file(parsed: ObjectSpec, path: Path) -> Any:
    mod_name = f"_attn_ledger_user_{abs(hash(str(path.resolve())))}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise SetupError(f"{parsed.field}: cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module
    parent = str(path.resolve().parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    try:
        with user_call(parsed.importing()):
            mod_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise SetupError(f"{parsed.field}: {parsed.importing()} {outcome(exc)}") from None
    finally:
        if added:
            sys.path.remove(parent)
    return module


def _import_module(parsed: ObjectSpec) -> Any:
    try:
        with user_call(parsed.importing()):
            return importlib.import_module(str(parsed.source))
    except Exception as exc:
        raise SetupError(f"{parsed.field}: {parsed.importing()} {outcome(exc)}") from None
