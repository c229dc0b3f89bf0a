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

# public name -> the module that defines it
_PUBLIC = {
    # reports
    "Report": "attn_ledger.report", "Row": "attn_ledger.report", "Check": "attn_ledger.report",
    "Finding": "attn_ledger.report", "Coverage": "attn_ledger.report",
    # the ledger
    "load_config": "attn_ledger.inputs.config", "run_ledger": "attn_ledger.ledger",
    "ledger_on_qkv": "attn_ledger.ledger", "run_ledger_tensors": "attn_ledger.ledger",
    # checking a kernel or module
    "check_kernel": "attn_ledger.probes.kernel.check", "select_cases": "attn_ledger.probes.kernel.check",
    "case_inputs": "attn_ledger.probes.kernel.check", "check_case": "attn_ledger.probes.kernel.check",
    "check_module": "attn_ledger.probes.module.check", "check_built_module": "attn_ledger.probes.module.check",
    "load_object": "attn_ledger.inputs.userload",
    "assert_attention_matches": "attn_ledger.testing", "assert_module_matches": "attn_ledger.testing",
    # a whole model's attention calls
    "scan_model": "attn_ledger.probes.model.scan", "assert_model_attention_ok": "attn_ledger.testing",
    "assert_models_agree": "attn_ledger.testing",
    # experiments
    "run_catalogue": "attn_ledger.probes.catalogue", "sweep_scale": "attn_ledger.experiments.scale",
    "temperature_lab": "attn_ledger.experiments.scale", "polarity": "attn_ledger.experiments.polarity",
    "run_intervene": "attn_ledger.experiments.intervene", "causal_intervention": "attn_ledger.probes.common.forward",
    # rendering and lower-level pieces
    "reference_attention": "attn_ledger.maths.reference",
    "retain_freed_memory": "attn_ledger.alloc",
}

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
