"""Time ``attn-ledger check`` on the default grid for a correct float32 kernel.

    python benchmarks/bench_check.py [--runs 5]

Prints the median wall time of several runs of the whole default grid (float32, float64,
float16 and bfloat16 cases) on fixtures/kernels/good.py. Target: under 10 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from attn_ledger.kernelcheck import DEFAULT_GRID, check_kernel
from attn_ledger.testing import diagnosis
from attn_ledger.userload import load_object

GOOD = Path(__file__).resolve().parents[1] / "fixtures" / "kernels" / "good.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    fn = load_object(f"{GOOD}:attention")
    check_kernel(fn)  # warm-up: first calls pay for lazy initialisation
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        report = check_kernel(fn)
        times.append(time.perf_counter() - start)
        if report.exit_code:
            raise SystemExit("the good kernel failed the grid:\n" + diagnosis(report))
    print(f"default grid: {len(DEFAULT_GRID)} cases, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"median {statistics.median(times):.3f} s over {args.runs} runs "
          f"(min {min(times):.3f} s, max {max(times):.3f} s)")


if __name__ == "__main__":
    main()
