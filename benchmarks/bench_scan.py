#!/usr/bin/env python
"""What ``attn-ledger scan`` costs next to a plain forward of the same model: time and peak memory, as ratios.

Each configuration runs in a fresh Python process, so that its peak resident memory is its own:

1. build the model (random weights, seeded) and its inputs, run one forward to warm up;
2. time ``--repeat`` plain forwards (``torch.no_grad``, eval) and take the median; read the peak RSS
   (``ru_maxrss``): the plain forward's peak, the model included;
3. time ``--repeat`` scans of the same model on the same inputs (:func:`attn_ledger.scan_model`: the capture
   through the attention interface, the judge of every call, the stage ledger of a first wrong call if
   there were one), median; read the peak RSS again: the process's peak over both, the scan's.

It prints, per configuration, the medians and ``scan / plain`` for time and peak RSS. The targets: scan
time <= 5x the plain forward at T = 1024, peak RSS <= 1.5x. The scan here runs in one process, as the
pytest helper does; ``attn-ledger scan`` runs the model in a worker and judges in its own process (the
model's memory in the worker, the judge's in the parent), which ``--cli`` times end to end beside a plain
forward run the same way (both including interpreter start, imports and the model's build).

Usage:
    python benchmarks/bench_scan.py                 every configuration
    python benchmarks/bench_scan.py --only gpt2-small-1024 --repeat 5
    python benchmarks/bench_scan.py --cli           also the command line, end to end
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "llama-4l-256": {"model_type": "llama", "tiny": True, "set": {"num_hidden_layers": 4}, "batch": 2, "seq_len": 256},
    "llama-4l-1024": {"model_type": "llama", "tiny": True, "set": {"num_hidden_layers": 4}, "batch": 2, "seq_len": 1024},
    "gpt2-small-1024": {"model_type": "gpt2", "tiny": False,
                        "set": {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
                        "batch": 1, "seq_len": 1024},
}

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from attn_ledger.probes.model.targets import Target, build
from attn_ledger.probes.model.inputs import InputPlan, make_inputs
from attn_ledger.probes.model.driver import model_facts
from attn_ledger import scan_model

cfg, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
t = Target("transformers", cfg["model_type"], overrides=tuple(cfg["set"].items()))
if not cfg["tiny"]:
    from attn_ledger.probes.model import targets
    targets.tiny_defaults = lambda *a, **k: {}
model, _ = build(t)
facts = model_facts(model, None, cfg["model_type"])
inputs = make_inputs(InputPlan(cfg["batch"], cfg["seq_len"], "none", 0), facts)
inputs["use_cache"] = False

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

with torch.no_grad():
    model(**inputs)
    plain = []
    for _ in range(repeat):
        t0 = time.perf_counter(); model(**inputs); plain.append(time.perf_counter() - t0)
plain_peak = peak_mib()
given = {k: v for k, v in inputs.items() if k != "use_cache"}
scans, verdict, notes = [], None, []
for _ in range(repeat):
    t0 = time.perf_counter()
    report = scan_model(model, given, label=cfg["model_type"])
    scans.append(time.perf_counter() - t0)
    verdict = report.verdict
from attn_ledger.render.notes import notes_text
print(json.dumps({"plain_s": statistics.median(plain), "scan_s": statistics.median(scans), "plain_peak_mib": plain_peak,
                  "scan_peak_mib": peak_mib(), "verdict": verdict, "calls": len(report.rows),
                  "reference": [n for n in notes_text(report) if n.startswith("float64 reference")]}))
"""

CLI_PLAIN = r"""
import json, sys, torch
from attn_ledger.probes.model.targets import Target, build
from attn_ledger.probes.model.inputs import InputPlan, make_inputs
from attn_ledger.probes.model.driver import model_facts
cfg = json.loads(sys.argv[1])
t = Target("transformers", cfg["model_type"], overrides=tuple(cfg["set"].items()))
if not cfg["tiny"]:
    from attn_ledger.probes.model import targets
    targets.tiny_defaults = lambda *a, **k: {}
model, _ = build(t)
inputs = make_inputs(InputPlan(cfg["batch"], cfg["seq_len"], "none", 0), model_facts(model, None, "m"))
with torch.no_grad():
    model(**inputs, use_cache=False)
"""


def run_child(code: str, cfg: dict, repeat: int, threads: int) -> dict:
    """Run a benchmark child (``code``, given the configuration, repeats and threads) in a fresh process; its last line's JSON."""
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cfg), str(repeat), str(threads)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the benchmark's child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cli(name: str, cfg: dict, repeat: int) -> tuple[float, float]:
    """Median wall time of a plain forward's whole process and of ``attn-ledger scan``'s (model built from scratch)."""
    sets = [a for k, v in cfg["set"].items() for a in ("--set", f"{k}={v}")]
    model = ["--transformers", cfg["model_type"]]
    if not cfg["tiny"]:
        import tempfile

        path = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"model_type": cfg["model_type"], **cfg["set"]}, path)
        path.close()
        model, sets = ["--transformers", path.name], []
    scan = ["attn-ledger", "scan", *model, *sets, "--batch", str(cfg["batch"]), "--seq-len", str(cfg["seq_len"])]
    plain, scans = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLI_PLAIN, json.dumps(cfg)], check=True, capture_output=True)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = subprocess.run(scan, capture_output=True, text=True)
        scans.append(time.perf_counter() - t0)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{name}: attn-ledger scan exited {done.returncode}:\n{done.stderr[-2000:]}")
    return statistics.median(plain), statistics.median(scans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS), help="run only this configuration")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (median), default 3")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the child, default 1")
    parser.add_argument("--cli", action="store_true", help="also time the command line end to end")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), "
          f"median of {args.repeat}")
    print(f"{'configuration':<17} {'plain s':>8} {'scan s':>8} {'time x':>7} {'plain MiB':>10} {'scan MiB':>9} "
          f"{'RSS x':>6}  calls  verdict")
    for name in args.only or list(CONFIGS):
        r = run_child(CHILD, CONFIGS[name], args.repeat, args.threads)
        print(f"{name:<17} {r['plain_s']:8.3f} {r['scan_s']:8.3f} {r['scan_s'] / r['plain_s']:7.2f} "
              f"{r['plain_peak_mib']:10.0f} {r['scan_peak_mib']:9.0f} {r['scan_peak_mib'] / r['plain_peak_mib']:6.2f}"
              f"  {r['calls']:5d}  {r['verdict']}")
        for line in r["reference"]:
            print(f"  {line}")
        if args.cli:
            plain, scan = _cli(name, CONFIGS[name], args.repeat)
            print(f"  command line, whole process: plain {plain:.2f} s, attn-ledger scan {scan:.2f} s, "
                  f"x {scan / plain:.2f}")


if __name__ == "__main__":
    main()
