"""The public surface: the names docs/library.md documents import from ``attn_ledger`` without loading torch,
and each old module path imports its new module for one release, warning once."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import attn_ledger

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_package_loads_no_torch_and_a_public_name_loads_its_module():
    code = ("import sys, attn_ledger; assert 'torch' not in sys.modules, 'torch on import';"
            "from attn_ledger import run_ledger, Report; import attn_ledger.ledger as L; assert run_ledger is L.run_ledger;"
            "print(set(attn_ledger.__all__) <= set(dir(attn_ledger)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"  # every public name is listed by dir(), before any is used


@pytest.mark.parametrize("name", sorted(attn_ledger._PUBLIC))
def test_every_public_name_resolves_to_its_module(name):
    module = importlib.import_module(attn_ledger._PUBLIC[name])
    assert getattr(attn_ledger, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        attn_ledger.nothing_here  # noqa: B018


def test_the_library_page_imports_only_from_the_package_or_documented_subpackages():
    page = (ROOT / "docs" / "library.md").read_text()
    sources = set(re.findall(r"^>>> from (attn_ledger[\w.]*) import", page, re.M))
    sources |= set(re.findall(r"^>>> import (attn_ledger[\w.]*)", page, re.M))
    documented = {"attn_ledger", "attn_ledger.testing"}
    assert sources and all(s in documented or s.split(".")[:2] == ["attn_ledger", "render"] for s in sources), sources


def test_the_reproduction_line_uses_the_public_path():
    from attn_ledger.probes.kernel.check import check_kernel, select_cases
    from attn_ledger.maths.reference import reference_attention

    def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
        return reference_attention(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale).to(q.dtype) * 1.5

    case = "b1-h1kv1-tq2tk2-dh4dv4-none-rand-f32"
    report = check_kernel(attention, select_cases([case]), target="k.py:attention", backward=False)
    from attn_ledger.render.notes import python_lines

    python = python_lines(report.details["reproduce"])
    assert python[0] == "from attn_ledger import case_inputs"
    namespace: dict = {}
    exec(python[0], namespace)  # the line runs as printed
    assert namespace["case_inputs"] is attn_ledger.case_inputs



@pytest.mark.parametrize("old", sorted(attn_ledger._MOVED))
def test_an_old_module_path_warns_once_with_its_new_path_and_gives_the_new_module(old):
    sys.modules.pop(f"attn_ledger.{old}", None)
    new = attn_ledger._MOVED[old]
    names = [f"attn_ledger.{n}" for n in ((new,) if isinstance(new, str) else new)]
    with pytest.warns(DeprecationWarning, match=re.escape(f"attn_ledger.{old} has moved to {' and '.join(names)}")):
        module = importlib.import_module(f"attn_ledger.{old}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second import is silent
        assert importlib.import_module(f"attn_ledger.{old}") is module
    if isinstance(new, str):
        assert module is importlib.import_module(names[0])
    else:  # the limits of old: bounds in inputs.limits, estimates in engine.budget
        assert module.parse_size("1K") == 1024 and callable(module.estimate_run)
    sys.modules.pop(f"attn_ledger.{old}", None)


def test_an_old_path_imports_no_torch_by_itself():
    code = ("import sys, warnings; warnings.simplefilter('ignore'); import attn_ledger.errors;"
            "import attn_ledger.paths; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
