"""Margins of ``check --protocol transformers`` at this CPU capability: the worst correct ``value / limit``
of each bounded check and dtype over correct functions, cases and seeds, and the smallest ratio by which
each buggy function's first finding is past its limit.

Usage: ATEN_CPU_CAPABILITY=default python scripts/interface_margins.py [--tier default|full] [--seeds 2]

Correct functions: ``fixtures/interface/custom.py:my_attention`` (every feature declared) and, where
transformers is installed, its own eager functions of Llama, Gemma 2 and gpt-oss and its sdpa function,
each with its true declaration. Buggy ones: the others of ``fixtures/interface/custom.py``. Prints two
Markdown tables. Exit status 0 when every correct function passes with ``value / limit <= 0.5`` and every
buggy one is caught on every seed, 1 otherwise, 2 without transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 0.5
CORRECT = {  # name: (module, attribute, masks, supports)
    "custom": ("custom", "my_attention", ("sdpa", "eager", "none"), ("window", "softcap", "sinks")),
    "llama eager": ("transformers.models.llama.modeling_llama", "eager_attention_forward", ("eager",), ()),
    "gemma2 eager": ("transformers.models.gemma2.modeling_gemma2", "eager_attention_forward", ("eager",), ("softcap",)),
    "gpt-oss eager": ("transformers.models.gpt_oss.modeling_gpt_oss", "eager_attention_forward", ("eager",), ("sinks",)),
    "sdpa": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward", ("sdpa", "eager", "none"), ()),
}
BUGGY = ("kv_not_repeated", "kv_tiled", "scaling_ignored", "mask_flipped", "softcap_ignored", "sinks_dropped",
         "heads_first", "window_too_wide")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default="default", choices=("default", "full"))
    ap.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    args = ap.parse_args(argv)
    try:
        importlib.import_module("transformers.masking_utils")
    except ImportError:
        print("needs transformers (the 'real' extra)", file=sys.stderr)
        return 2
    import torch

    from attn_ledger.probes.interface.cases import parse_icase
    from attn_ledger.probes.interface.check import Declaration, check_interface

    sys.path.insert(0, str(ROOT / "fixtures" / "interface"))
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    ok = True
    for name, (mod, attr, masks, supports) in CORRECT.items():
        fn = getattr(importlib.import_module(mod), attr)
        for seed in range(args.seeds):
            r = check_interface(fn, target=name, declaration=Declaration(masks=masks, supports=supports), seed=seed,
                                tier=args.tier)
            ok &= r.exit_code == 0
            for row in r.rows:
                dtype = parse_icase(row.name).dtype_name
                for c in row.checks:
                    if c.status == "pass" and c.limit and c.value is not None and c.limit > 0:
                        q = c.value / c.limit
                        if q > worst.get((c.name, dtype), (-1.0, ""))[0]:
                            worst[(c.name, dtype)] = (q, f"{name}, {row.name}, seed {seed}")
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, tier {args.tier}, seeds 0-{args.seeds - 1}\n")
    print("| check | dtype | worst correct value / limit | where |\n| --- | --- | --- | --- |")
    for (check, dtype), (q, where) in sorted(worst.items()):
        ok &= q <= MARGIN
        print(f"| {check} | {dtype} | {q:.3f} | {where} |")
    import custom

    print("\n| buggy function | first finding | caught | smallest value / limit |\n| --- | --- | --- | --- |")
    full = Declaration(supports=("window", "softcap", "sinks"))
    for bug in BUGGY:
        seen, least = set(), float("inf")
        caught = 0
        for seed in range(args.seeds):
            r = check_interface(getattr(custom, bug), target=bug, declaration=full, seed=seed, tier=args.tier)
            f = r.first_finding
            caught += f is not None
            if f is not None:
                seen.add(f"L{f.level} {f.name}")
                if f.check.limit:
                    least = min(least, f.check.value / f.check.limit)
        ok &= caught == args.seeds
        print(f"| {bug} | {', '.join(sorted(seen))} | {caught} of {args.seeds} | "
              f"{'-' if least == float('inf') else f'{least:.3g}'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
