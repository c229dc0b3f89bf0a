"""Run ``check`` in this process on every kernel of the correct-kernel corpus and print JSON.

Usage: python scripts/corpus.py [--tier default|full] [--seeds 0,1,...] [--kernels correct|near|all]
       [--only NAME,...] [--json FILE]

The corpus is ``fixtures/kernels/correct/*.py`` (files starting with ``_`` are helpers), one style of
correct attention per file, each with ``attention`` under the kernel protocol. A file may declare, as
module-level literals (read without importing it):

* ``REQUIRES = ("transformers",)``: packages it needs; without them the file is listed as skipped.
* ``DECLARATION = {...}``: ``[tool.attn-ledger.check]`` keys (``{"backward": False}`` for a kernel
  without a backward).
* ``EMPTY_ROWS = "any"``: its contract for a query whose every key is blocked.
* ``PRECISION_WARNING = True``: it computes float64 cases at float32 precision, so ``precision``
  warnings are real.

``--kernels near`` runs the near-threshold faults of the catalogue instead (``power`` in the output),
and the imprecise half kernels of ``fixtures/kernels/precision`` (``precision:NAME``), caught when
``check`` warns on ``precision`` or fails.
The capability is whatever ``ATEN_CPU_CAPABILITY`` says when this process starts (the fork server
keeps the environment it started with, so each capability needs its own process); the output says
which one torch runs at, and ``fell_back`` where the machine lacks the requested one.

Each check with a bound (``op`` ``<=`` and a positive ``limit``) is reduced to ``value / limit``; the
output keeps the worst such ratio per (check, dtype) with its kernel, case and seed, and every
failure and warning.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "kernels" / "correct"
MARKERS = ("REQUIRES", "DECLARATION", "EMPTY_ROWS", "PRECISION_WARNING")


def markers(path: Path) -> dict[str, Any]:
    """The module-level literals of :data:`MARKERS` in ``path``, read with ``ast`` (nothing is imported)."""
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in MARKERS:
                found[name] = ast.literal_eval(node.value)
    return found


def _shown(path: Path) -> str:
    """The path as a reproduction line shows it: relative to the repository where it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def corpus_files() -> list[Path]:
    return sorted(p for p in CORPUS.glob("*.py") if not p.name.startswith("_"))


def capability() -> dict[str, Any]:
    """What was asked for (``ATEN_CPU_CAPABILITY``) and what torch runs at."""
    import torch

    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    actual = torch.backends.cpu.get_cpu_capability()
    fell_back = asked is not None and asked.lower() != actual.lower()
    return {"requested": asked, "actual": actual, "fell_back": fell_back}


def _bounded(check: Any) -> bool:
    return (check.op == "<=" and isinstance(check.value, (int, float)) and isinstance(check.limit, (int, float))
            and check.limit > 0)


def _dtype(case_id: str) -> str:
    from attn_ledger.probes.kernel.check import parse_case

    return parse_case(case_id).dtype_name


def judge(report: Any, name: str, seed: int, worst: dict[tuple[str, str], dict[str, Any]],
          real_precision: bool = False) -> dict[str, Any]:
    """Fold one report into ``worst`` (per check and dtype); return its failures, warnings and largest
    ratio per check and dtype (``ratios[check][dtype]``). A kernel whose ``precision`` warnings are real
    (``real_precision``) leaves that check out of ``worst``: its margin there is not a margin."""
    failures, warns = [], []
    ratios: dict[str, dict[str, float]] = {}
    grads = 0
    for case, c in report.checks():
        grads += int(c.name == "grad_q" and c.judged)
        item = {"case": case, "check": c.name, "status": c.status, "value": c.value, "limit": c.limit,
                "seed": seed}
        if c.failed:
            failures.append(item)
        elif c.status == "warn":
            warns.append(item)
        if not _bounded(c) or (real_precision and c.name == "precision"):
            continue
        ratio = float(c.value) / float(c.limit)
        key = (c.name, _dtype(case))
        if key not in worst or ratio > worst[key]["ratio"]:
            worst[key] = {"check": c.name, "dtype": key[1], "ratio": ratio, "kernel": name, "case": case,
                          "seed": seed, "value": c.value, "limit": c.limit}
        per_dtype = ratios.setdefault(c.name, {})
        per_dtype[key[1]] = max(per_dtype.get(key[1], 0.0), ratio)
    return {"failures": failures, "warnings": warns, "ratios": ratios, "backward_cases": grads}


def _loaded(only: set[str] | None) -> tuple[list[tuple[str, Path, Any, Any, dict[str, Any]]], dict[str, str]]:
    """The corpus's kernels to run (name, path, function, declaration, entry) and those skipped, with why."""
    from attn_ledger.inputs.userload import load_object
    from attn_ledger.probes.kernel.spec import declaration

    found, skipped = [], {}
    for path in corpus_files():
        name = path.stem
        if only is not None and name not in only:
            continue
        marks = markers(path)
        missing = [p for p in marks.get("REQUIRES", ()) if importlib.util.find_spec(p) is None]
        if missing:
            skipped[name] = f"needs {', '.join(missing)}"
            continue
        decl = declaration(marks.get("DECLARATION", {}), source=f"{path.name} DECLARATION ")
        entry: dict[str, Any] = {"failures": [], "warnings": [], "seconds": 0.0, "cases": 0, "backward_cases": 0,
                                 "empty_rows": marks.get("EMPTY_ROWS", "zeros"),
                                 "precision_warning_expected": bool(marks.get("PRECISION_WARNING", False)),
                                 "backward": decl.backward}
        found.append((name, path, load_object(f"{path}:attention"), decl, entry))
    return found, skipped


def run_correct(tier: str, seeds: list[int], only: set[str] | None, shared: bool = True) -> dict[str, Any]:
    """Every corpus kernel at every seed. Seed by seed, every kernel is judged against one set of each case's
    kernel-free references (``shared``: :func:`attn_ledger.probes.kernel.check.shared_references`, reused only
    on bitwise the same inputs), so the float64 reference, magnitudes and plain computations run once per
    (case, seed) instead of once per kernel; the checks and bounds are a lone ``check``'s."""
    from attn_ledger.probes.kernel.check import check_kernel, shared_references

    kernels, skipped = _loaded(only)
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    for seed in seeds:
        with shared_references() if shared else contextlib.nullcontext():
            for name, path, fn, decl, entry in kernels:
                start = time.perf_counter()
                report = check_kernel(fn, tier=tier, target=f"{_shown(path)}:attention", seed=seed,
                                      empty_rows=entry["empty_rows"], declaration=decl)
                entry["seconds"] += time.perf_counter() - start
                entry["cases"] += len(report.rows)
                seen = judge(report, name, seed, worst, entry["precision_warning_expected"])
                entry["backward_cases"] += seen["backward_cases"]
                entry["failures"] += seen["failures"]
                entry["warnings"] += seen["warnings"]
    for *_, entry in kernels:
        entry["seconds"] = round(entry["seconds"], 2)
    rows = sorted(worst.values(), key=lambda w: (w["check"], w["dtype"]))
    return {"kernels": {name: entry for name, *_, entry in kernels}, "skipped": skipped, "worst": rows}


def run_near(tier: str, seeds: list[int], only: set[str] | None) -> dict[str, Any]:
    """Each near-threshold fault of the catalogue: caught (some check failed) at each seed, and its ratios."""
    from attn_ledger.probes.catalogue import NEAR_THRESHOLD
    from attn_ledger.probes.kernel.check import check_kernel

    power: dict[str, Any] = {}
    for fault in NEAR_THRESHOLD:
        if only is not None and fault.name not in only:
            continue
        runs = []
        for seed in seeds:
            report = check_kernel(fault.target, tier=tier, target=f"attn_ledger.probes.catalogue:{fault.target.__name__}",
                                  seed=seed)
            seen = judge(report, fault.name, seed, {})
            failed = sorted({f["check"] for f in seen["failures"]})
            runs.append({"seed": seed, "caught": report.exit_code == 1, "failed_checks": failed,
                         "ratios": seen["ratios"]})
        power[fault.name] = {"summary": fault.summary, "runs": runs}
    power.update(run_precision(tier, seeds, only))
    return {"power": power}


PRECISION = ROOT / "fixtures" / "kernels" / "precision"


def run_precision(tier: str, seeds: list[int], only: set[str] | None) -> dict[str, Any]:
    """The imprecise half kernels of ``fixtures/kernels/precision`` (correct to their own precision, not to
    the inputs'): at each seed whether ``check`` warns on ``precision`` (or fails), and the largest ratio
    of each bounded check, ``precision``'s being the ratio over the half-precision bar. Forward only:
    the bar judges the output."""
    from attn_ledger.probes.kernel.check import check_kernel
    from attn_ledger.inputs.userload import load_object

    power: dict[str, Any] = {}
    for path in sorted(p for p in PRECISION.glob("*.py") if not p.name.startswith("_")):
        name = f"precision:{path.stem}"
        if only is not None and name not in only and path.stem not in only:
            continue
        fn = load_object(f"{path}:attention")
        runs = []
        for seed in seeds:
            report = check_kernel(fn, tier=tier, target=f"{_shown(path)}:attention", seed=seed, backward=False)
            seen = judge(report, name, seed, {})
            warned = any(w["check"] == "precision" for w in seen["warnings"])
            runs.append({"seed": seed, "caught": report.exit_code == 1 or warned,
                         "failed_checks": sorted({f["check"] for f in seen["failures"]}), "ratios": seen["ratios"]})
        doc = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split("\n")[0]
        power[name] = {"summary": doc, "runs": runs}
    return power


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default="default", choices=("default", "full"))
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--kernels", default="correct", choices=("correct", "near", "all"))
    ap.add_argument("--only", default=None, help="comma-separated kernel (file stem) or fault names")
    ap.add_argument("--json", default=None, help="write the JSON here instead of stdout")
    ap.add_argument("--no-shared", action="store_true",
                    help="compute each case's references afresh for every kernel (as a lone check does)")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"--seeds: got {args.seeds!r}, expected comma-separated integers", file=sys.stderr)
        return 2
    only = None if args.only is None else set(args.only.split(","))
    import warnings

    # eager flex_attention says it is not compiled, once per call; it is the point of running it eagerly
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    start = time.perf_counter()
    cap = capability()
    if cap["fell_back"]:
        print(f"ATEN_CPU_CAPABILITY={cap['requested']} asked for, but torch runs at {cap['actual']}: "
              "this machine lacks it", file=sys.stderr)
    out: dict[str, Any] = {"capability": cap, "tier": args.tier, "seeds": seeds}
    if args.kernels in ("correct", "all"):
        out.update(run_correct(args.tier, seeds, only, shared=not args.no_shared))
    if args.kernels in ("near", "all"):
        out.update(run_near(args.tier, seeds, only))
    out["seconds"] = round(time.perf_counter() - start, 2)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
