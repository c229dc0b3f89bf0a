"""Whether this tree's ledger gives the same reports as a git revision's, value for value.

Usage: python scripts/same_reports.py --baseline REV [--json FILE]

A change meant only to make the ledger faster must not move a number. This runs one set of
ledgers in this tree and in ``git archive REV`` (unpacked into a temporary directory), each side in
its own process with its own root first on ``PYTHONPATH``, and compares their JSON reports
(:func:`attn_ledger.render.jsondoc.report_json`) case by case:

* ``ledger_on_qkv`` on seeded q, k, v: each tensor relation (``none``, ``causal``,
  ``causal-top-left``, ``sliding-window``, ``prefix-lm``) in float32, float64, float16 and bfloat16
  at four shapes, (1, 8, 512, 64) in float32; grouped-query heads with Tq != Tk; scores large enough
  to overflow; given weights (wrong and right) and context; kept grids; ``grad``; soft-cap; sinks;
  small blocks; key padding with and without declared empty rows;
* ``run_ledger`` on configs: each fault of ``RunConfig`` with what it needs (``grad``, ``rope``,
  ``softcap``, ``sinks``, a sliding window), the faults of the forward at five settings, and the
  ``padding`` and ``segments`` relations.

A case that raises is compared by its error's type and first line. Prints each case that differs
with the first path where it does, and exits 0 when every case is equal, 1 when one differs, 2 on
bad arguments or when a side cannot run. Both sides need the modules named above (any revision since
the package was split into folders). About a minute a side here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((1, 2, 16, 8), (2, 4, 64, 16), (1, 2, 300, 32), (1, 8, 512, 64))
RELATIONS = ("none", "causal", "causal-top-left", "sliding-window", "prefix-lm")


def _qkv_cases(torch: Any) -> dict[str, tuple[tuple, dict]]:
    """``{name: ((q, k, v), kwargs)}`` for ``ledger_on_qkv``, seeded."""
    g = torch.Generator().manual_seed(11)

    def rnd(*shape: int, dtype: Any = torch.float32) -> Any:
        return torch.randn(*shape, generator=g).to(dtype)

    cases: dict[str, tuple[tuple, dict]] = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for shape in SHAPES:
            if shape[2] == 512 and dtype != torch.float32:
                continue
            qkv = tuple(rnd(*shape, dtype=dtype) for _ in range(3))
            for mask in RELATIONS:
                extra = {"window": 8} if mask == "sliding-window" else {"prefix_len": 5} if mask == "prefix-lm" else {}
                cases[f"{dtype}-{shape}-{mask}"] = (qkv, {"mask": mask, **extra})
    cases["gqa-causal"] = ((rnd(1, 8, 40, 16), rnd(1, 2, 96, 16), rnd(1, 2, 96, 16)), {"mask": "causal"})
    q, k, v = rnd(1, 4, 256, 32), rnd(1, 4, 256, 32), rnd(1, 4, 256, 32)
    allow = torch.ones(256, 256, dtype=torch.bool).tril()
    right = torch.softmax(torch.where(allow, (q @ k.transpose(-1, -2)) / math.sqrt(32), -math.inf), -1)
    valid = torch.ones(1, 256, dtype=torch.bool)
    valid[:, 200:] = False
    cases.update({
        "large-scores": ((q * 30, k * 30, v), {"mask": "causal"}),
        "given-weights-wrong": ((q, k, v), {"mask": "causal", "weights": torch.softmax(rnd(1, 4, 256, 256), -1)}),
        "given-weights-and-out": ((q, k, v), {"mask": "causal", "weights": right, "out": right @ v}),
        "keep-grids": ((q, k, v), {"mask": "causal", "keep_grids": True}),
        "grad": ((q[:, :, :64], k[:, :, :64], v[:, :, :64]), {"mask": "causal", "grad": True}),
        "softcap": ((q, k, v), {"mask": "causal", "softcap": 5.0}),
        "sinks": ((q, k, v), {"mask": "causal", "sinks": [0.5, -0.2, 0.1, 0.0]}),
        "blocks-of-16": ((q, k, v), {"mask": "causal", "block_size": 16}),
        "key-valid": ((q, k, v), {"mask": "none", "key_valid": valid}),
        "key-valid-causal-empty-zeros": ((q, k, v), {"mask": "causal", "key_valid": valid, "empty_rows": "zeros"}),
    })
    return cases


def _config_cases() -> dict[str, dict]:
    """``{name: RunConfig fields}`` for ``run_ledger``."""
    from attn_ledger.inputs import config as C

    cases: dict[str, dict] = {}
    for fault in (None, *C.FAULTS):
        for kw in ({"seq_len": 24}, {"seq_len": 300, "mask": "causal"},
                   {"seq_len": 40, "mask": "sliding-window", "window": 6},
                   {"seq_len": 64, "mask": "none", "dtype": "float16"}, {"seq_len": 48, "mask": "causal", "grad": True}):
            cases[f"{fault}-{sorted(kw.items())}"] = {"fault": fault, **kw}
    needs = [(C.GRAD_FAULTS, {"grad": True}), (C.ROPE_FAULTS, {"rope": "half"}), (C.PROPERTY_FAULTS, {}),
             (C.CAP_FAULTS, {"softcap": 5.0}), (C.SINK_FAULTS, {"sinks": "0.5"}),
             (C.SINK_GRAD_FAULTS, {"sinks": "0.5", "grad": True}),
             (C.WINDOW_FAULTS, {"mask": "sliding-window", "window": 6, "seq_len": 40})]
    for faults, kw in needs:
        for fault in faults:
            cases[fault] = {"fault": fault, "seq_len": 32, **kw}
    cases["padding"] = {"seq_len": 40, "mask": "padding", "valid_lengths": [30, 40]}
    cases["causal+padding"] = {"seq_len": 40, "mask": "causal+padding", "valid_lengths": [30, 40]}
    cases["segments"] = {"seq_len": 40, "mask": "segments", "segment_lengths": [10, 30]}
    return cases


def _dump(path: str) -> None:
    """Run every case in this process (whichever attn_ledger is first on the path) and write the reports."""
    import torch

    from attn_ledger.inputs.config import RunConfig
    from attn_ledger.ledger import ledger_on_qkv, run_ledger
    from attn_ledger.render.jsondoc import report_json

    found: dict[str, Any] = {}

    def record(name: str, run: Any) -> None:
        try:
            found[name] = report_json(run())
        except Exception as exc:  # an error is a result too: compared by its type and first line
            found[name] = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    for name, (qkv, kw) in _qkv_cases(torch).items():
        record(f"qkv {name}", lambda: ledger_on_qkv(*qkv, **kw))
    for name, fields in _config_cases().items():
        record(f"config {name}", lambda: run_ledger(RunConfig(**fields)))
    Path(path).write_text(json.dumps(found, sort_keys=True, default=str))


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first path (``/rows[2]/checks[0]/value``) where two JSON values differ, with both values; None if equal."""
    if type(a) is not type(b):
        return f"{path or '/'}: {a!r:.80} | {b!r:.80}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}/{key}: only on one side"
            found = first_difference(a[key], b[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items | {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path or '/'}: {a!r:.80} | {b!r:.80}"


def _side(root: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", str(out)], env=env, cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"same_reports: the side at {root} could not run: {tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="the git revision to compare this tree with")
    parser.add_argument("--json", help="write each differing case and where it differs to this file")
    parser.add_argument("--dump", help=argparse.SUPPRESS)  # the worker: run the cases, write the reports
    args = parser.parse_args(argv)
    if args.dump:
        _dump(args.dump)
        return 0
    if not args.baseline:
        parser.error("--baseline: got nothing, expected a git revision")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, capture_output=True)
        if archive.returncode != 0:
            print(f"same_reports: --baseline: got {args.baseline!r}, expected a revision of this repository",
                  file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        try:
            _side(base, Path(tmp) / "baseline.json")
            _side(ROOT, Path(tmp) / "current.json")
        except SystemExit as exc:
            print(exc, file=sys.stderr)
            return 2
        before = json.loads((Path(tmp) / "baseline.json").read_text())
        after = json.loads((Path(tmp) / "current.json").read_text())
    differ = {name: first_difference(before.get(name), after.get(name))
              for name in sorted(set(before) | set(after))}
    differ = {name: where for name, where in differ.items() if where}
    for name, where in differ.items():
        print(f"differs: {name}: {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(differ, indent=1))
    print(f"{len(before)} cases: {len(differ)} differ from {args.baseline}" if differ else
          f"{len(before)} cases: every report equal to {args.baseline}'s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
