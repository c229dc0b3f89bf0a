"""Time ``attn-ledger check`` on the default grid for a correct float32 kernel, or ``check --module``.

    python benchmarks/bench_check.py [--runs 5]
    python benchmarks/bench_check.py --decode [--runs 3]
    python benchmarks/bench_check.py --module [--runs 3]

Prints the median wall time of several runs of the whole default grid (float32, float64,
float16 and bfloat16 cases) on fixtures/kernels/good.py. Target: under 10 s on 2 CPU cores.

``--decode`` times the KV-cache decode checks of ``check --module --decode`` instead (E=256,
Nh=8, 32 decoded positions; a correct rotary module, and one whose offset is off by one so
every scenario is diagnosed), with the load average beside them. Target: under 20 s.

With ``--module``: the median wall time of ``check --module`` on the correct Llama-style
fixture (grouped-query attention with rotary positions) at E=256, Nh=8, T=32, B=2, every
check including the observed core and gradcheck, beside one SDPA call of the same attention
in the same process. Target: under 20 s. The load average is printed with the times, since
the machine's other work shows in them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from attn_ledger.kernelcheck import DEFAULT_GRID, check_kernel
from attn_ledger.testing import diagnosis
from attn_ledger.userload import load_object

GOOD = Path(__file__).resolve().parents[1] / "fixtures" / "kernels" / "good.py"
DECODE_MODULES = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "decode_modules.py"
MODULES = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "attention_modules.py"


def bench_module(runs: int) -> None:
    """``check --module`` on the Llama-style fixture at E=256, Nh=8, T=32, B=2: medians and the load."""
    import torch.nn.functional as F

    from attn_ledger.modulecheck import check_module
    from attn_ledger.testing import module_diagnosis

    factory = load_object(f"{MODULES}:llama_style")
    e, nh, t, b = 256, 8, 32, 2
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        report = check_module(factory, e, nh, seq_len=t, batch_size=b)
        times.append(time.perf_counter() - start)
        if report.exit_code:
            raise SystemExit("the Llama-style fixture failed the module check:\n" + module_diagnosis(report))
    q = torch.randn(b, nh, t, e // nh)
    sdpa = []
    for _ in range(max(20, runs)):
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        sdpa.append(time.perf_counter() - start)
    load_after = os.getloadavg()
    median = statistics.median(times)
    print(f"check --module llama_style E={e} Nh={nh} T={t} B={b}: torch {torch.__version__}, "
          f"{len(report.checks())} checks (run on 1 intra-op thread; the process has {threads})")
    print(f"median {median:.2f} s over {runs} runs (min {min(times):.2f} s, max {max(times):.2f} s); target 20 s")
    print(f"one SDPA call [{b}, {nh}, {t}, {e // nh}]: median {statistics.median(sdpa) * 1e6:.0f} us; "
          f"ratio {median / statistics.median(sdpa):.3g}")
    print("load average (1, 5, 15 min): before " + ", ".join(f"{v:.2f}" for v in load_before)
          + "; after " + ", ".join(f"{v:.2f}" for v in load_after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode", action="store_true", help="time the decode checks of check --module --decode")
    parser.add_argument("--module", action="store_true", help="time check --module instead of the kernel grid")
    args = parser.parse_args()
    if args.decode:
        decode_section(args.runs)
        return
    if args.module:
        bench_module(args.runs)
        return
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


def decode_section(runs: int, embed_dim: int = 256, num_heads: int = 8, length: int = 32) -> None:
    """Median wall time of the decode checks on a correct module and on one that fails every scenario."""
    import torch.nn.functional as F

    from attn_ledger.decodecheck import decode_rows, plan_scenarios

    calls = sum(sc.calls for sc in plan_scenarios(length))
    print(f"decode checks: E={embed_dim} Nh={num_heads} T={length}, {calls} decode calls, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    q = torch.randn(2, num_heads, length, embed_dim // num_heads)  # [B, Nh, T, Dh]
    sdpa = _median_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), 50)
    for factory, decode, expect in (("past_rotary", "decode_past", 0), ("plain_rotary", "decode_list", 0),
                                    ("past_rotary", "decode_past_off_by_one", 1)):
        torch.manual_seed(0)
        module = load_object(f"{DECODE_MODULES}:{factory}")(embed_dim, num_heads)
        fn = load_object(f"{DECODE_MODULES}:{decode}")
        times = []
        for _ in range(runs):
            load = os.getloadavg()[0]
            start = time.perf_counter()
            rows, _ = decode_rows(module, fn, embed_dim, length=length)
            times.append(time.perf_counter() - start)
            failed = sum(r.status == "fail" for r in rows)
            if (failed > 0) != bool(expect):
                raise SystemExit(f"{factory} + {decode}: {failed} failing rows, "
                                 f"expected {'some' if expect else 'none'}")
        med = statistics.median(times)
        print(f"{factory} + {decode}: median {med:.2f} s over {runs} runs (min {min(times):.2f}, max {max(times):.2f}; "
              f"target 20 s), {med / sdpa:.0f}x one SDPA call at [2, {num_heads}, {length}, {embed_dim // num_heads}], "
              f"{failed} failing rows, load average {load:.1f} at the last start, {os.getloadavg()[0]:.1f} at the end")


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
