"""Time ``attn-ledger check`` on its default and full tiers for a correct plain torch kernel, or ``check --module``.

    python benchmarks/bench_check.py [--runs 3] [--full-runs 1]
    python benchmarks/bench_check.py --decode [--runs 3]
    python benchmarks/bench_check.py --module [--runs 3]

Runs fixtures/kernels/good.py (grouped kv heads expanded, the causal relation built, then
F.scaled_dot_product_attention) through the path the CLI takes: the worker process
(:func:`attn_ledger.runner.worker.run_user_task`), the argument check, every case with its backward
checks, and the report. Prints the CPU model, the load average before and after, the median
wall time of the default tier (target: at most 10 s) and of the full tier (target: at most
120 s), and one whole ``attn-ledger check`` process (interpreter and torch import included).

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
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from attn_ledger.probes.kernel.cases import tier_cases
from attn_ledger.testing import diagnosis
from attn_ledger.inputs.userload import load_object
from attn_ledger.runner.worker import run_user_task

ROOT = Path(__file__).resolve().parents[1]
GOOD = ROOT / "fixtures" / "kernels" / "good.py"
DECODE_MODULES = ROOT / "fixtures" / "modules" / "decode_modules.py"
MODULES = ROOT / "fixtures" / "modules" / "attention_modules.py"
TARGETS = {"default": 10.0, "full": 120.0}


def bench_module(runs: int) -> None:
    """``check --module`` on the Llama-style fixture at E=256, Nh=8, T=32, B=2: medians and the load."""
    import torch.nn.functional as F

    from attn_ledger.probes.module.check import check_module
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


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tier_run(tier: str) -> float:
    """One run of a tier through the worker, as ``attn-ledger check GOOD [--full]`` does; its wall time."""
    args = {"target": f"{GOOD}:attention", "field": "target", "cases": list(tier_cases(tier)),
            "tier": tier, "empty_rows": "zeros", "seed": 0, "backward": True, "strict_precision": False,
            "device": "cpu", "declaration": {}}
    start = time.perf_counter()
    report = run_user_task("kernel_check", args).report
    elapsed = time.perf_counter() - start
    if report.exit_code:
        raise SystemExit(f"the good kernel failed the {tier} tier:\n" + diagnosis(report))
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the default tier")
    parser.add_argument("--full-runs", type=int, default=1, help="runs of the full tier (0: skip it)")
    parser.add_argument("--decode", action="store_true", help="time the decode checks of check --module --decode")
    parser.add_argument("--module", action="store_true", help="time check --module on the Llama-style fixture")
    args = parser.parse_args()
    if args.decode:
        decode_section(args.runs)
        return
    if args.module:
        bench_module(args.runs)
        return
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")
    tier_run("default")  # warm-up: the first worker of a process pays for the fork server's torch import
    for tier, runs in (("default", args.runs), ("full", args.full_runs)):
        if runs < 1:
            continue
        times = [tier_run(tier) for _ in range(runs)]
        med = statistics.median(times)
        print(f"{tier} tier: {len(tier_cases(tier))} cases, median {med:.1f} s over {runs} runs "
              f"(min {min(times):.1f}, max {max(times):.1f}; target {TARGETS[tier]:.0f} s), "
              f"load average {os.getloadavg()[0]:.1f} at the end")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "attn_ledger", "check", f"{GOOD}:attention", "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT)
    print(f"one whole 'attn-ledger check' process on the default tier: {time.perf_counter() - start:.1f} s "
          f"(exit {proc.returncode}; interpreter, torch import and worker start included)")


def decode_section(runs: int, embed_dim: int = 256, num_heads: int = 8, length: int = 32) -> None:
    """Median wall time of the decode checks on a correct module and on one that fails every scenario."""
    import torch.nn.functional as F

    from attn_ledger.probes.module.decode import decode_rows, plan_scenarios

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
