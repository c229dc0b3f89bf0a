"""attn-ledger: stage-by-stage diagnosis of attention code that runs but is wrong.

The library's public names are importable from here, and importing this package loads
nothing heavy: each name imports its module (and torch) on first use. docs/library.md
documents them; docs/architecture.md shows the folders they live in.

Old module paths (``attn_ledger.kernelcheck``, ``attn_ledger.config``, ...) still import for
one release, each warning once (``DeprecationWarning``) with its new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Any

from attn_ledger._version import __version__

# the module that defines them -> public names, in the order __all__ lists them
_PUBLIC_BY_MODULE = (
    # reports
    ("report", ("Report", "Row", "Check", "Finding", "Coverage")),
    # the ledger
    ("inputs.config", ("load_config",)),
    ("ledger", ("run_ledger", "ledger_on_qkv", "run_ledger_tensors")),
    # checking a kernel or module
    ("probes.kernel.check", ("check_kernel", "select_cases", "case_inputs", "check_case")),
    ("probes.module.check", ("check_module", "check_built_module")),
    ("inputs.userload", ("load_object",)),
    ("testing", ("assert_attention_matches", "assert_module_matches")),
    # a whole model's attention calls
    ("probes.model.scan", ("scan_model",)),
    ("testing", ("assert_model_attention_ok", "assert_models_agree")),
    # experiments
    ("probes.catalogue", ("run_catalogue",)),
    ("experiments.scale", ("sweep_scale", "temperature_lab")),
    ("experiments.polarity", ("polarity",)),
    ("experiments.intervene", ("run_intervene",)),
    ("probes.common.forward", ("causal_intervention",)),
    # rendering and lower-level pieces
    ("maths.reference", ("reference_attention",)),
    ("alloc", ("retain_freed_memory",)),
)
# public name -> the module that defines it
_PUBLIC = {name: f"attn_ledger.{module}" for module, names in _PUBLIC_BY_MODULE for name in names}

__all__ = ["__version__", *_PUBLIC]

# old module path -> new one (a tuple: the old module's names now live in several)
_MOVED: dict[str, str | tuple[str, ...]] = {
    "worker": "runner.worker", "usertasks": "runner.tasks", "reaper": "runner.reaper",
    "catalogue": "probes.catalogue",
    "kernelcheck": "probes.kernel.check", "kernelcases": "probes.kernel.cases", "kernelspec": "probes.kernel.spec",
    "kernelref": "probes.kernel.reference", "kernelgrad": "probes.kernel.grad", "driver": "probes.common.driver",
    "modulecheck": "probes.module.check", "modulegrads": "probes.module.grads", "decodecheck": "probes.module.decode",
    "coreaudit": "probes.module.core", "corefit": "probes.module.fit", "headtrace": "probes.module.heads",
    "intervention": "probes.common.forward", "observe": "probes.common.observe",
    "stages": "engine.stages", "checks": "engine.checks", "cells": "engine.locate", "engine.inputs": "engine.given",
    "config": "inputs.config", "tensorio": "inputs.tensorio", "paths": "inputs.paths", "userload": "inputs.userload",
    "limits": ("inputs.limits", "engine.budget"),
    "pipeline": "maths.pipeline", "reference": "maths.reference", "masks": "maths.masks",
    "engine.relations": "maths.relations", "rotary": "maths.rotary", "model": "maths.layer",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:  # attn_ledger.kernelcheck used as an attribute, without importing it first
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Joined(types.ModuleType):
    """An old module whose names now live in several new ones: each name is looked up in turn."""

    def __init__(self, name: str, targets: list[types.ModuleType]) -> None:
        super().__init__(name)
        self._targets = targets

    def __getattr__(self, attr: str) -> Any:
        for target in self._targets:
            if hasattr(target, attr):
                return getattr(target, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as its new module, warning the first time (the module is cached after)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        old = fullname.removeprefix(f"{__name__}.")
        if fullname == old or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> types.ModuleType:
        new = _MOVED[spec.name.removeprefix(f"{__name__}.")]
        names = [f"{__name__}.{n}" for n in ((new,) if isinstance(new, str) else new)]
        warnings.warn(f"{spec.name} has moved to {' and '.join(names)}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        modules = [importlib.import_module(n) for n in names]
        return modules[0] if len(modules) == 1 else _Joined(spec.name, modules)

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the new module ran when it was imported


if not any(isinstance(f, _OldPath) for f in sys.meta_path):
    sys.meta_path.append(_OldPath())
