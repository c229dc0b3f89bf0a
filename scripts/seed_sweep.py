"""Run ``sweep-scale``'s relationship checks over many seeds and count how many pass.

Usage: python scripts/seed_sweep.py [--seeds 100] [--queries 512] [--keys 512] [--dh 8,32,128,512]

The issue asks that the default sizes make every check hold for at least 99 of 100
seeds; this prints the count and, for failing seeds, which check failed.
"""

from __future__ import annotations

import argparse
import time

from attn_ledger.experiments.scale import DEFAULT_KEYS, DEFAULT_QUERIES, parse_dh, sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--queries", type=int, default=DEFAULT_QUERIES)
    ap.add_argument("--keys", type=int, default=DEFAULT_KEYS)
    ap.add_argument("--dh", default="8,32,128,512")
    args = ap.parse_args()
    dh = parse_dh(args.dh)
    start = time.perf_counter()
    passed = 0
    worst: dict[str, float] = {}
    for seed in range(args.seeds):
        report = sweep(dh, args.queries, args.keys, seed)
        for _, c in report.checks():
            if c.value is not None and c.name != "raw_entropy_falling":
                worst[c.name] = max(worst.get(c.name, 0.0), c.value)
        if report.verdict == "pass":
            passed += 1
        else:
            failed = [c.name for _, c in report.failures()]
            print(f"seed {seed}: failed {', '.join(failed)}")
    elapsed = time.perf_counter() - start
    print(f"Tq={args.queries} Tk={args.keys} Dh={','.join(map(str, dh))}: "
          f"{passed} of {args.seeds} seeds pass ({elapsed / args.seeds:.3f} s per seed)")
    for name, value in worst.items():
        print(f"  worst {name}: {value:.4f}")


if __name__ == "__main__":
    main()
