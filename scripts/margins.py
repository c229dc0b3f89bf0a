"""Margins of ``check``'s bounds both ways: the correct-kernel corpus's worst error / bound, and the
near-threshold faults' smallest, over seeds and CPU capabilities.

Usage: python scripts/margins.py [--seeds 10] [--tier default|full] [--capabilities unset,avx2,default]
       [--json FILE]

For each capability (``unset`` leaves ``ATEN_CPU_CAPABILITY`` out) one process runs
``scripts/corpus.py --kernels all`` over the seeds 0..N-1; this one folds their output into two
Markdown tables (for docs/check.md):

* the worst correct kernel's ``value / limit`` for each (check, dtype) over every kernel, case, seed and
  capability, with the kernel, case, seed and capability where it was met. It should stay <= 0.5
  (``precision`` in half precision, a ratio of errors: <= 0.7, just above the 1 / 1.5 where a kernel
  computing as the plain computations sits).
* for each near-threshold fault of the catalogue, and each imprecise half kernel of
  ``fixtures/kernels/precision`` (``precision:NAME``, caught by the ``precision`` warning), the seeds
  (times capabilities) where ``check`` caught it, and for each bounded check and dtype the smallest
  over those runs of its largest ``value / limit`` (> 1 where that check alone catches it on every
  run). The correct kernels' ``precision`` row of the first table and these rows are the half-precision
  bar's two margins.

Exit status 0 when every correct kernel passed with margin <= 0.5 and every fault was caught on every
run, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CAPABILITIES = ("unset", "avx2", "default")
DTYPE_ORDER = ("float32", "float64", "float16", "bfloat16")
POWER_CHECKS = ("reference", "precision", "grad_q", "grad_k", "grad_v", "forbidden_keys")
MARGIN = 0.5
# precision in half precision is a ratio of errors, not an error over a bound: a correct kernel that computes
# as one of the plain computations sits at 1 / HALF_PRECISION_RATIO (0.667), its margin by construction, and
# another summation order moves it a little (grouped query heads: 1.00013 / 1.5)
PRECISION_MARGIN = 0.7
HALF = ("float16", "bfloat16")


def margin(check: str, dtype: str) -> float:
    """The largest value / limit a correct kernel may reach for ``check`` in ``dtype``."""
    return PRECISION_MARGIN if check == "precision" and dtype in HALF else MARGIN


def run_capabilities(caps: list[str], seeds: int, tier: str) -> dict[str, dict[str, Any]]:
    """``scripts/corpus.py --kernels all`` in one fresh process per capability, all at once."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for cap in caps:
            env = dict(os.environ)
            env.pop("ATEN_CPU_CAPABILITY", None)
            if cap != "unset":
                env["ATEN_CPU_CAPABILITY"] = cap
            out = Path(tmp) / f"{cap}.json"
            cmd = [sys.executable, str(HERE / "corpus.py"), "--kernels", "all", "--tier", tier,
                   "--seeds", ",".join(str(s) for s in range(seeds)), "--json", str(out)]
            procs[cap] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                          out)
        runs = {}
        for cap, (proc, out) in procs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"capability {cap}: scripts/corpus.py exited {proc.returncode}:\n{err[-2000:]}")
            if err.strip():
                print(f"[{cap}] {err.strip().splitlines()[-1]}", file=sys.stderr)
            runs[cap] = json.loads(out.read_text(encoding="utf-8"))
        return runs


def _dtype_key(name: str) -> int:
    return DTYPE_ORDER.index(name) if name in DTYPE_ORDER else len(DTYPE_ORDER)


def fold(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The worst correct-kernel ratio per (check, dtype), the failures, and the faults' power, over capabilities."""
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    failures, warnings, skipped = [], [], {}
    power: dict[str, dict[str, Any]] = {}
    for cap, run in runs.items():
        skipped.update(run.get("skipped", {}))
        for w in run.get("worst", []):
            key = (w["check"], w["dtype"])
            if key not in worst or w["ratio"] > worst[key]["ratio"]:
                worst[key] = {**w, "capability": cap, "actual": run["capability"]["actual"]}
        for name, entry in run.get("kernels", {}).items():
            failures += [{**f, "kernel": name, "capability": cap} for f in entry["failures"]]
            real = entry["precision_warning_expected"]
            warnings += [{**f, "kernel": name, "capability": cap, "expected": real and f["check"] == "precision"}
                         for f in entry["warnings"]]
        for name, entry in run.get("power", {}).items():
            p = power.setdefault(name, {"summary": entry["summary"], "runs": 0, "caught": 0, "smallest": {}})
            for r in entry["runs"]:
                p["runs"] += 1
                p["caught"] += int(r["caught"])
                for check, per_dtype in r["ratios"].items():
                    for dtype, ratio in per_dtype.items():
                        cell = p["smallest"].setdefault(check, {})
                        cell[dtype] = min(cell.get(dtype, float("inf")), ratio)
    rows = sorted(worst.values(), key=lambda w: (w["check"], _dtype_key(w["dtype"])))
    return {"worst": rows, "failures": failures, "warnings": warnings, "skipped": skipped, "power": power}


def _ratio(x: float) -> str:
    if x == float("inf"):
        return "inf"
    return f"{x:.3g}" if x < 1000 else f"{x:.2e}"


def margins_table(folded: dict[str, Any]) -> str:
    lines = ["| check | dtype | worst error / bound | kernel | case | seed | capability |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for w in folded["worst"]:
        if w["ratio"] == 0.0 and w["check"] not in ("reference", "grad_q", "grad_k", "grad_v"):
            continue  # exact where no rounding enters (a probe's unmoved rows): nothing to show
        mark = f" **over {margin(w['check'], w['dtype']):.3g}**" if w["ratio"] > margin(w["check"], w["dtype"]) else ""
        lines.append(f"| `{w['check']}` | {w['dtype']} | {_ratio(w['ratio'])}{mark} | `{w['kernel']}` | "
                     f"`{w['case']}` | {w['seed']} | {w['capability']} ({w['actual']}) |")
    return "\n".join(lines)


def power_table(folded: dict[str, Any]) -> str:
    dtypes = sorted({d for p in folded["power"].values() for c in p["smallest"].values() for d in c}, key=_dtype_key)
    lines = ["| fault | caught | check | " + " | ".join(dtypes) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in dtypes) + " |"]
    for name, p in folded["power"].items():
        first = True
        for check in POWER_CHECKS:
            if check not in p["smallest"]:
                continue
            cells = [_ratio(p["smallest"][check][d]) if d in p["smallest"][check] else "-" for d in dtypes]
            head = f"`{name}` | {p['caught']} of {p['runs']}" if first else " | "
            lines.append(f"| {head} | `{check}` | " + " | ".join(cells) + " |")
            first = False
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    ap.add_argument("--tier", default="default", choices=("default", "full"))
    ap.add_argument("--capabilities", default=",".join(CAPABILITIES),
                    help="comma-separated: unset (ATEN_CPU_CAPABILITY left out), avx2, avx512, default")
    ap.add_argument("--json", default=None, help="also write the folded result here")
    args = ap.parse_args(argv)
    caps = [c.strip() for c in args.capabilities.split(",") if c.strip()]
    bad = [c for c in caps if c not in ("unset", "avx2", "avx512", "default", "zvector", "vsx")]
    if args.seeds < 1 or not caps or bad:
        print(f"--seeds/--capabilities: got {args.seeds}, {args.capabilities!r}; expected a positive count and "
              "capabilities among unset, avx2, avx512, default", file=sys.stderr)
        return 2
    runs = run_capabilities(caps, args.seeds, args.tier)
    folded = fold(runs)
    folded["capabilities"] = {cap: run["capability"] for cap, run in runs.items()}
    folded["seconds"] = {cap: run["seconds"] for cap, run in runs.items()}
    print(f"Margins: `python scripts/margins.py --seeds {args.seeds} --tier {args.tier} "
          f"--capabilities {','.join(caps)}`\n")
    for cap, c in folded["capabilities"].items():
        note = " (fell back: this machine lacks it)" if c["fell_back"] else ""
        print(f"- {cap}: torch ran at {c['actual']}{note}, {folded['seconds'][cap]:.0f} s")
    if folded["skipped"]:
        print("- skipped: " + ", ".join(f"{k} ({v})" for k, v in sorted(folded["skipped"].items())))
    print("\nCorrect kernels, worst error / bound (checks whose worst is exactly 0, the probes' unmoved rows, "
          "are left out):\n")
    print(margins_table(folded))
    print("\nNear-threshold faults, smallest over runs of the largest error / bound:\n")
    print(power_table(folded))
    unexpected = [w for w in folded["warnings"] if not w["expected"]]
    print(f"\n{len(folded['failures'])} failures and {len(unexpected)} unexpected warnings of correct kernels"
          + (":" if folded["failures"] or unexpected else ""))
    seen = set()
    for f in folded["failures"] + unexpected:
        key = (f["kernel"], f["check"], f["capability"])
        if key not in seen:
            seen.add(key)
            print(f"- {f['kernel']} {f['check']} ({f['status']}) at {f['capability']}, e.g. seed {f['seed']} "
                  f"{f['case']}: {f['value']} (limit {f['limit']})")
    if args.json:
        Path(args.json).write_text(json.dumps(folded, indent=1) + "\n", encoding="utf-8")
    over = [w for w in folded["worst"] if w["ratio"] > margin(w["check"], w["dtype"])]
    missed = [n for n, p in folded["power"].items() if p["caught"] < p["runs"]]
    return 1 if folded["failures"] or unexpected or over or missed else 0


if __name__ == "__main__":
    sys.exit(main())
