#!/usr/bin/env python
"""What ``attn-ledger compare`` costs next to the two plain forwards it compares: time and peak memory, as ratios.

Each configuration runs in a fresh Python process, so that its peak resident memory is its own:

1. build both runs of ``--vary attn-implementation=eager,sdpa`` as the command does (random weights, seeded; run
   B given run A's weights; the plain models the bound is made of), and the inputs; one forward of each run to
   warm up;
2. time ``--repeat`` pairs of plain forwards (run A's model then run B's, ``torch.no_grad``, eval, no cache) and
   take the median; read the peak RSS (``ru_maxrss``): the plain forwards' peak, every model of the pair built;
3. time ``--repeat`` compares of the same runs on the same inputs
   (:func:`attn_ledger.probes.model.compare.compare` through a ``LocalModel``: both runs block by block, B's
   block replayed on A's input, the plain models in each dtype and in float64 replayed the same way, every
   row judged; the first adder's attention ledger where a block fails), median; read the peak RSS again.

It prints, per configuration, the medians and ``compare / two plain forwards`` for time, and the peak RSS after
the plain forwards and after the compares. The target: compare time <= 8x the two plain forwards at T = 1024.
The models are ``bench_scan.py``'s: a 4-layer tiny Llama at T = 256 and 1024 (B = 2), and GPT-2 small's
shape with random weights at B = 1, T = 1024; no padding, as there.

Usage:
    python benchmarks/bench_compare.py                 every configuration
    python benchmarks/bench_compare.py --only gpt2-small-1024 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scan import CONFIGS, run_child  # noqa: E402  the same models as scan's benchmark, run the same way

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from attn_ledger.probes.model import targets
from attn_ledger.probes.model.compare import compare, parse_vary, runs
from attn_ledger.probes.model.driver import LocalModel, setup
from attn_ledger.probes.model.inputs import InputPlan, make_inputs

cfg, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
if not cfg["tiny"]:
    targets.tiny_defaults = lambda *a, **k: {}
plan = InputPlan(cfg["batch"], cfg["seq_len"], "none", 0)
r = runs(parse_vary("attn-implementation=eager,sdpa"), cfg["model_type"],
         overrides=[f"{k}={v}" for k, v in cfg["set"].items()], plan=plan)
pair, _ = setup(r.args())
handle = LocalModel(pair)
inputs = {**make_inputs(plan, handle.facts), "use_cache": False}

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

with torch.no_grad():
    pair.a(**inputs); pair.b(**inputs)
    plain = []
    for _ in range(repeat):
        t0 = time.perf_counter(); pair.a(**inputs); pair.b(**inputs); plain.append(time.perf_counter() - t0)
plain_peak = peak_mib()
times, report = [], None
for _ in range(repeat):
    t0 = time.perf_counter()
    report = compare(handle, r)
    times.append(time.perf_counter() - t0)
blocks = [row for row in report.rows if row.fields.get("layer") is not None]
room = min((row.fields["room"] for row in blocks if row.fields.get("room")), default=None)
print(json.dumps({"plain_s": statistics.median(plain), "compare_s": statistics.median(times),
                  "plain_peak_mib": plain_peak, "compare_peak_mib": peak_mib(), "verdict": report.verdict,
                  "blocks": len(blocks), "least_room": room}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS), help="run only this configuration")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (median), default 3")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the child, default 1")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), "
          f"median of {args.repeat}; --vary attn-implementation=eager,sdpa; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'configuration':<17} {'2 plain s':>9} {'compare s':>9} {'time x':>7} {'plain MiB':>10} "
          f"{'compare MiB':>11} {'RSS x':>6}  blocks  least room  verdict")
    for name in args.only or list(CONFIGS):
        r = run_child(CHILD, CONFIGS[name], args.repeat, args.threads)
        room = "-" if r["least_room"] is None else f"{r['least_room']:.1f}"
        print(f"{name:<17} {r['plain_s']:9.3f} {r['compare_s']:9.3f} {r['compare_s'] / r['plain_s']:7.2f} "
              f"{r['plain_peak_mib']:10.0f} {r['compare_peak_mib']:11.0f} "
              f"{r['compare_peak_mib'] / r['plain_peak_mib']:6.2f}  {r['blocks']:6d}  {room:>10}  {r['verdict']}",
              flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
