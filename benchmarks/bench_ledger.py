"""Ledger cost against F.scaled_dot_product_attention, on the same q, k, v in one process.

For each shape (B, Nh, T, Dh), causal, float32:

* time: ``attn_ledger.ledger.ledger_on_qkv(q, k, v, mask="causal")`` and
  ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` called alternately, ``--repeats``
  rounds (at least SHORT_REPEATS for shapes where SDPA takes under 50 ms) after one warm-up
  round; each time is the median over rounds, and ledger / SDPA is the median of the
  per-round ratios, so a slow spell on a shared machine hits both sides of a ratio alike;
* allocator: by default the process keeps freed memory for reuse, as the ``attn-ledger``
  command does for its own process (``attn_ledger.alloc.retain_freed_memory``);
  ``--allocator default`` measures under the C library's own policy instead;
* peak resident memory of each call: the high-water mark is reset before the call by writing
  ``5`` to ``/proc/self/clear_refs`` and read afterwards from ``VmHWM`` in ``/proc/self/status``
  (shown as the process peak and as the growth over the resident size just before the call).

``--cli`` also runs ``attn-ledger run --tensors FILE --mask causal`` at (1, 32, 8192, 128) in a
subprocess (the file is written first, as .safetensors in a temporary directory) and reports its
wall time and peak resident memory (``/usr/bin/time -v`` where present, else ``getrusage``).

``--grad`` measures the backward instead, at (1, 8, 4096, 128): ``ledger_on_qkv(..., grad=True)`` (the
forward ledger, the properties and the backward stages, streamed over query blocks) against SDPA's
forward plus backward (autograd with the same ``O-bar`` of ones), paired as above, with the forward
ledger alone beside them; it prints the ratio and the peak resident memory of the ``--grad`` ledger
against the forward ledger's, and exits 1 if it is twice that or more.

``--baseline REV`` compares the ledger at a git revision with the one in this tree instead:
``git archive REV`` is unpacked into a temporary directory, and ``--workers`` (3) worker
processes are started for each side, with that directory or this tree first on PYTHONPATH.
Each measures its own ledger / SDPA ratio in its own process (paired calls, as above). The
parent asks every worker in turn, round after round, so a slow spell of the machine falls on
both sides. Several processes per side, because one process runs a few percent faster or slower
than another of the same code (where its buffers land in memory): two processes of one revision
differ by up to about 3% at (1, 8, 512, 64) here. Per shape it prints the median ratio of each
side over all its workers' rounds, current / baseline, the 3.0x target, each worker's own median
and each side's median milliseconds, and exits 1 if any current median is more than
``--max-slowdown`` (5%) above the baseline's. A third set of workers runs this tree's ledger with
its ``properties`` row left out (a row revisions before it do not have), in the same turns, so the
same run shows what that row costs; the current ledger's row is also timed inside each call. The
verdict is always on the whole current ledger.

Prints Markdown tables ready for docs/performance.md, with the machine they came from.

Usage::

    python benchmarks/bench_ledger.py                 # ratio shapes and the T = 512..8192 table
    python benchmarks/bench_ledger.py --cli           # plus the 8192 CLI run
    python benchmarks/bench_ledger.py --device cuda   # CUDA shapes (memory columns are host RSS)
    python benchmarks/bench_ledger.py --baseline de39edb   # this tree against a revision, side by side
    python benchmarks/bench_ledger.py --baseline de39edb --shapes 1,8,512,64   # one shape only
    python benchmarks/bench_ledger.py --grad          # the backward at (1, 8, 4096, 128), time and peak memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SKIP_PROPERTIES = "ATTN_LEDGER_BENCH_SKIP_PROPERTIES"  # set in the attribution side's workers of --baseline
RATIO_SHAPES = [(1, 8, 512, 64), (1, 32, 2048, 128), (1, 8, 4096, 128)]
GRAD_SHAPE = (1, 8, 4096, 128)
GRAD_MEMORY_LIMIT = 2.0  # the --grad ledger's peak resident memory stays under this many times the forward ledger's
SCALE_TS = [512, 1024, 2048, 4096, 8192]
CLI_SHAPE = (1, 32, 8192, 128)
SHORT_REPEATS = 31  # rounds for shapes whose SDPA call takes under 50 ms
TARGET = 3.0  # ledger / SDPA
ROOT = Path(__file__).resolve().parent.parent


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _call(fn, sync) -> tuple[float, float, float]:
    """One call: (seconds, peak RSS MiB, peak growth over the RSS just before the call MiB)."""
    can_reset = _reset_peak()
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    sync()
    dt = time.perf_counter() - t0
    hwm = _status_kib("VmHWM") if can_reset else 0
    return dt, hwm / 1024, (hwm - before) / 1024


def _paired(fns, repeats: int, sync) -> list[tuple[float, float, float, float]]:
    """Call each of ``fns`` once per round, ``repeats`` rounds after one warm-up round.

    Alternating the calls means a slow spell on a shared machine hits both sides alike.
    Returns per function: (median seconds, median of the per-round time ratios to the first
    function, peak RSS MiB, peak growth MiB).
    """
    for fn in fns:
        fn()
        sync()
    rounds = [[_call(fn, sync) for fn in fns] for _ in range(repeats)]
    out = []
    for i in range(len(fns)):
        times = [r[i][0] for r in rounds]
        ratios = [r[i][0] / r[0][0] for r in rounds]
        out.append((statistics.median(times), statistics.median(ratios),
                    max(r[i][1] for r in rounds), max(r[i][2] for r in rounds)))
    return out


def machine(device: str) -> str:
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = _meminfo_gib()
    text = (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {mem:.0f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}")
    if device == "cuda":
        text += f", GPU {torch.cuda.get_device_name()}"
    return text


def _meminfo_gib() -> float:
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        return int(m.group(1)) / 2**20 if m else 0.0
    except OSError:
        return 0.0


def _finding(led) -> object:
    """The headline of a ledger: ``first_finding``, or ``first_divergence`` in revisions before the one report model."""
    return led.first_finding if hasattr(led, "first_finding") else led.first_divergence


def bench_shape(shape: tuple[int, int, int, int], repeats: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from attn_ledger.ledger import ledger_on_qkv

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(device) for _ in range(3))  # [B, Nh, T, Dh]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    verdicts = []

    def ledger():
        led = ledger_on_qkv(q, k, v, mask="causal")
        verdicts.append(_finding(led))

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    t0 = time.perf_counter()
    sdpa()
    sync()
    if time.perf_counter() - t0 < 0.05:  # short calls: more rounds, or the median is mostly noise
        repeats = max(repeats, SHORT_REPEATS)
    (sd_t, _, sd_peak, sd_grow), (lg_t, ratio, lg_peak, lg_grow) = _paired([sdpa, ledger], repeats, sync)
    if any(d is not None for d in verdicts):
        raise SystemExit(f"healthy ledger diverged at {shape}: {verdicts[-1]}")
    return {"shape": shape, "sdpa_s": sd_t, "ledger_s": lg_t, "ratio": ratio, "repeats": repeats,
            "sdpa_peak": sd_peak, "sdpa_grow": sd_grow, "ledger_peak": lg_peak, "ledger_grow": lg_grow}


def bench_grad(shape: tuple[int, int, int, int], repeats: int, device: str) -> dict:
    """The ``--grad`` ledger against SDPA forward + backward, the forward ledger beside them (paired rounds)."""
    import torch
    import torch.nn.functional as F

    from attn_ledger.ledger import ledger_on_qkv

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(device) for _ in range(3))  # [B, Nh, T, Dh]
    go = torch.ones_like(q)  # O-bar = 1, as the ledger's default seed
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    verdicts = []

    def sdpa_fwd_bwd():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        torch.autograd.grad(out, leaves, go)

    def ledger_grad():
        verdicts.append(ledger_on_qkv(q, k, v, mask="causal", grad=True).first_finding)

    def ledger_fwd():
        verdicts.append(ledger_on_qkv(q, k, v, mask="causal").first_finding)

    (sd_t, _, _, _), (gr_t, ratio, _, _), (fw_t, fw_ratio, _, _) = _paired(
        [sdpa_fwd_bwd, ledger_grad, ledger_fwd], repeats, sync)
    if any(d is not None for d in verdicts):
        raise SystemExit(f"healthy ledger diverged at {shape}: {verdicts[-1]}")
    # peaks in fresh processes, one call each: in this one, memory a call frees is kept for the next
    peaks = {what: _peak_subprocess(shape, what, device) for what in ("inputs", "sdpa", "forward", "grad")}
    return {"shape": shape, "sdpa_s": sd_t, "grad_s": gr_t, "fwd_s": fw_t, "ratio": ratio, "fwd_ratio": fw_ratio,
            "peaks": peaks, "repeats": repeats}


def _peak_subprocess(shape: tuple[int, int, int, int], what: str, device: str) -> float:
    """Peak RSS (MiB) of a fresh process that makes the inputs and makes one call: ``inputs`` (none), ``sdpa``
    (forward + backward), ``forward`` (the ledger) or ``grad`` (the ledger with --grad)."""
    call = {
        "inputs": "pass",
        "sdpa": ("l=[t.clone().requires_grad_(True) for t in (q,k,v)];"
                 "torch.autograd.grad(F.scaled_dot_product_attention(*l,is_causal=True),l,torch.ones_like(q))"),
        "forward": "assert ledger_on_qkv(q,k,v,mask='causal').first_finding is None",
        "grad": "assert ledger_on_qkv(q,k,v,mask='causal',grad=True).first_finding is None",
    }[what]
    code = (
        "import re,torch,torch.nn.functional as F;from attn_ledger.alloc import retain_freed_memory;"
        "from attn_ledger.ledger import ledger_on_qkv;retain_freed_memory();g=torch.Generator().manual_seed(0);"
        f"q,k,v=(torch.randn(*{tuple(shape)},generator=g).to({device!r}) for _ in range(3));{call};"
        "print(re.search(r'VmHWM:\\s+(\\d+)',open('/proc/self/status').read()).group(1))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    try:
        return int(out.stdout.strip()) / 1024
    except ValueError:
        raise SystemExit(f"the {what} peak could not be measured: {out.stderr.strip()[-300:]}") from None


def print_grad(r: dict) -> int:
    """The ``--grad`` table; 1 if the --grad ledger's peak is twice the forward ledger's or more."""
    p = r["peaks"]
    within = p["grad"] < GRAD_MEMORY_LIMIT * p["forward"]
    print("| (B, Nh, T, Dh) | SDPA fwd+bwd ms | ledger --grad ms | ledger --grad / SDPA fwd+bwd | forward ledger ms "
          "| forward ledger / SDPA fwd+bwd |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {_fmt_shape(r['shape'])} | {r['sdpa_s'] * 1e3:.0f} | {r['grad_s'] * 1e3:.0f} | {r['ratio']:.2f} "
          f"| {r['fwd_s'] * 1e3:.0f} | {r['fwd_ratio']:.2f} |")
    print("\nPeak resident memory of a fresh process making the inputs and one call (MiB; growth over the inputs alone):\n")
    print("| inputs alone | SDPA fwd+bwd | forward ledger | ledger --grad | --grad / forward |")
    print("|---:|---:|---:|---:|---:|")
    grow = {k: v - p["inputs"] for k, v in p.items()}
    print(f"| {p['inputs']:.0f} | {p['sdpa']:.0f} (+{grow['sdpa']:.0f}) | {p['forward']:.0f} (+{grow['forward']:.0f}) "
          f"| {p['grad']:.0f} (+{grow['grad']:.0f}) | {p['grad'] / p['forward']:.2f} |")
    print(f"\n{'OK' if within else 'FAIL'}: the --grad ledger's peak resident memory is "
          f"{p['grad'] / p['forward']:.2f}x the forward ledger's (limit {GRAD_MEMORY_LIMIT:g}x)")
    return 0 if within else 1


def run_cli(shape: tuple[int, int, int, int]) -> dict:
    """``attn-ledger run --tensors FILE --mask causal`` in a subprocess: wall time and peak RSS."""
    import torch
    from safetensors.torch import save_file

    exe = shutil.which("attn-ledger") or str(Path(sys.executable).with_name("attn-ledger"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qkv.safetensors"
        g = torch.Generator().manual_seed(0)
        save_file({n: torch.randn(*shape, generator=g) for n in ("q", "k", "v")}, str(path))
        cmd = [exe, "run", "--tensors", str(path), "--mask", "causal", "--format", "json"]
        timer = shutil.which("time") if Path("/usr/bin/time").exists() else None
        timer = "/usr/bin/time" if Path("/usr/bin/time").exists() else timer
        t0 = time.perf_counter()
        if timer:
            proc = subprocess.run([timer, "-v", *cmd], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
            peak = int(m.group(1)) / 1024 if m else float("nan")
            how = "/usr/bin/time -v"
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            how = "getrusage(RUSAGE_CHILDREN)"
        import json

        try:
            verdict = json.loads(proc.stdout)["verdict"]
        except (ValueError, KeyError):
            verdict = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        sd_peak = _sdpa_subprocess(path)
    return {"shape": shape, "wall_s": wall, "peak_mib": peak, "how": how, "verdict": verdict,
            "exit": proc.returncode, "sdpa_peak_mib": sd_peak}


def _sdpa_subprocess(path: Path) -> float:
    """Peak RSS (MiB) of a fresh process that loads the same file and runs SDPA once."""
    code = (
        "import re,torch,torch.nn.functional as F;from safetensors.torch import load_file;"
        f"t=load_file({str(path)!r});F.scaled_dot_product_attention(t['q'],t['k'],t['v'],is_causal=True);"
        "print(re.search(r'VmHWM:\\s+(\\d+)',open('/proc/self/status').read()).group(1))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return int(out.stdout.strip()) / 1024
    except ValueError:
        return float("nan")


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(x) for x in shape) + ")"


# --- this tree against a revision -------------------------------------------------------

def worker() -> int:
    """Answer ratio requests on stdin, one JSON line each, with whatever ``attn_ledger`` is first on the path.

    ``{"shape": [B, Nh, T, Dh], "pairs": n}`` -> ``{"ratio": median of n per-pair ledger / SDPA ratios}``;
    the first request on a shape also makes its inputs and warms both calls up.
    """
    import torch
    import torch.nn.functional as F

    import attn_ledger.ledger
    from attn_ledger.ledger import ledger_on_qkv

    try:
        from attn_ledger.alloc import retain_freed_memory

        retain_freed_memory()
    except ImportError:  # a revision from before the allocator setting
        pass
    spent = [0.0]  # seconds in the properties row during the current call, where the revision has that row
    if hasattr(attn_ledger.ledger, "properties_row"):
        row = attn_ledger.ledger.properties_row
        if os.environ.get(SKIP_PROPERTIES):  # the attribution side: the same ledger without that one row

            def row(*args: Any, **kwargs: Any) -> None:
                return None

        def timed_row(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return row(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        attn_ledger.ledger.properties_row = timed_row
    print(json.dumps({"module": attn_ledger.ledger.__file__, "threads": torch.get_num_threads()}), flush=True)
    made: dict[tuple[int, ...], tuple] = {}
    for line in sys.stdin:
        req = json.loads(line)
        shape = tuple(req["shape"])
        if shape not in made:
            g = torch.Generator().manual_seed(0)
            made[shape] = tuple(torch.randn(*shape, generator=g) for _ in range(3))  # q, k, v [B, Nh, T, Dh]
            q, k, v = made[shape]
            if _finding(ledger_on_qkv(q, k, v, mask="causal")) is not None:
                raise SystemExit(f"healthy ledger diverged at {shape}")
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        q, k, v = made[shape]
        ratios, sdpa_s, ledger_s, props_s = [], [], [], []
        for _ in range(req["pairs"]):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            t1 = time.perf_counter()
            spent[0] = 0.0
            ledger_on_qkv(q, k, v, mask="causal")
            t2 = time.perf_counter()
            ratios.append((t2 - t1) / (t1 - t0))
            sdpa_s.append(t1 - t0)
            ledger_s.append(t2 - t1)
            props_s.append(spent[0])
        print(json.dumps({"ratio": statistics.median(ratios), "sdpa_s": statistics.median(sdpa_s),
                          "ledger_s": statistics.median(ledger_s), "properties_s": statistics.median(props_s)}),
              flush=True)
    return 0


class _Side:
    """A worker process running the ledger found first on ``path``."""

    def __init__(self, name: str, path: Path, extra_env: dict[str, str] | None = None) -> None:
        env = {**os.environ, **(extra_env or {}),
               "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(path))
        hello = self._read()
        self.module, self.threads = hello["module"], hello["threads"]
        if not Path(self.module).resolve().is_relative_to(path.resolve()):
            self.close()
            raise SystemExit(f"{name}: imported attn_ledger from {self.module}, expected it under {path}")

    def ask(self, shape: tuple[int, ...], pairs: int) -> dict:
        self.proc.stdin.write(json.dumps({"shape": list(shape), "pairs": pairs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the worker stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare_with(rev: str, rounds: int, max_slowdown: float, workers: int = 3,
                 shapes: list[tuple[int, int, int, int]] = RATIO_SHAPES) -> int:
    """This tree's ledger against ``rev``'s on ``shapes``, alternating round by round; 1 if any shape got slower
    than allowed."""
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_dir)], input=archive, check=True)
        base_row = "has one too" if _has_properties_row(base_dir) else "has no such row"
        sides = [[_Side(f"baseline {rev}", base_dir) for _ in range(workers)],
                 [_Side("current", ROOT) for _ in range(workers)],
                 [_Side("current without the properties row", ROOT, {SKIP_PROPERTIES: "1"}) for _ in range(workers)]]
        try:
            found = {shape: _rounds(sides, shape, rounds) for shape in shapes}
        finally:
            for side in sides:
                for w in side:
                    w.close()
    threads = "/".join(str(side[0].threads) for side in sides[:2])
    print(f"Machine: {machine('cpu')}; torch threads in the workers (baseline/current) {threads}; causal float32; "
          f"{workers} worker processes per side, each measuring ledger / SDPA in its own process (paired calls, "
          f"median per round); all workers of both sides take turns for {rounds} rounds; medians over every "
          f"worker's rounds\n")
    print(f"| (B, Nh, T, Dh) | baseline {rev} ledger / SDPA | current ledger / SDPA | current / baseline "
          f"| current within {TARGET:g}x | baseline ledger, SDPA ms | current ledger, SDPA ms "
          f"| current without the properties row / baseline |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    worst = 0.0
    per_worker = []
    for shape, (base, cur, bare) in found.items():
        b, c, n = (statistics.median(a["ratio"] for w in side for a in w) for side in (base, cur, bare))
        ms = ["{:.1f}, {:.1f}".format(*(1e3 * statistics.median(a[key] for w in side for a in w)
                                        for key in ("ledger_s", "sdpa_s"))) for side in (base, cur)]
        worst = max(worst, c / b)
        print(f"| {_fmt_shape(shape)} | {b:.2f} | {c:.2f} | {c / b:.3f} | {'yes' if c <= TARGET else 'no'} "
              f"| {ms[0]} | {ms[1]} | {n / b:.3f} |")
        props = 1e3 * statistics.median(a.get("properties_s", 0.0) for w in cur for a in w)
        per_worker.append(f"{_fmt_shape(shape)}: the current ledger's properties row {props:.2f} ms "
                          f"(timed inside the call; the baseline {base_row})")
        per_worker.append(f"{_fmt_shape(shape)}: baseline " + " / ".join(
            f"{statistics.median(a['ratio'] for a in w):.2f}" for w in base) + "; current " + " / ".join(
            f"{statistics.median(a['ratio'] for a in w):.2f}" for w in cur))
    print("\nEach worker's median ledger / SDPA, and the properties row's time:\n\n"
          + "\n".join(f"- {line}" for line in per_worker))
    limit = 1.0 + max_slowdown
    if worst > limit:
        print(f"\nFAIL: a current median is {worst:.3f}x the baseline's, above the allowed {limit:.2f}x", file=sys.stderr)
        return 1
    print(f"\nOK: every current median is within {limit:.2f}x the baseline's (worst {worst:.3f}x)")
    return 0


def _has_properties_row(tree: Path) -> bool:
    """Whether the ledger unpacked at ``tree`` has the ``properties`` row (revisions before it have no module for it)."""
    return any((tree / "attn_ledger" / where / "properties.py").is_file() for where in ("engine", "."))


def _rounds(sides: list[list[_Side]], shape: tuple[int, int, int, int], rounds: int) -> tuple[list, ...]:
    """Per-round answers of every worker of each side at ``shape`` (``ratio``, and the median ``ledger_s`` and
    ``sdpa_s`` of the round's pairs), as ``[worker][round]``; short shapes take several pairs a round."""
    first = [w.ask(shape, 1) for side in sides for w in side]  # warm-up, and how long SDPA takes here
    pairs = 5 if first[0]["sdpa_s"] < 0.05 else 1
    found: tuple[list, ...] = tuple([[] for _ in side] for side in sides)
    turn = [(s, i) for i in range(len(sides[0])) for s in range(len(sides))]  # worker 0 of each side, then worker 1, ...
    for r in range(rounds):
        for s, i in (turn if r % 2 == 0 else turn[::-1]):  # neither side always goes first
            found[s][i].append(sides[s][i].ask(shape, pairs))
    return found


def _shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``--shapes``: ``B,Nh,T,Dh`` shapes, ``;`` between them."""
    found = []
    for part in text.split(";"):
        dims = part.split(",")
        if len(dims) != 4 or not all(d.strip().isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(f"got {part!r}, expected four positive integers B,Nh,T,Dh")
        found.append(tuple(int(d) for d in dims))
    return found


def main(argv: list[str] | None = None) -> int:  # long only by its option list and the three tables it prints
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5,
                    help=f"timed rounds per shape (median); shapes whose SDPA takes under 50 ms get at least {SHORT_REPEATS}")
    ap.add_argument("--allocator", choices=["retain", "default"], default="retain",
                    help="retain: keep freed memory for reuse, as the attn-ledger command does for its process "
                         "(attn_ledger.alloc.retain_freed_memory); default: the C library's own policy")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-ratio", action="store_true", help="skip the three ratio shapes")
    ap.add_argument("--shapes", type=_shapes, default=RATIO_SHAPES, metavar="B,Nh,T,Dh[;...]",
                    help="the ratio shapes, ';' between shapes (default: the three above)")
    ap.add_argument("--skip-scale", action="store_true", help="skip the T = 512..8192 table")
    ap.add_argument("--scale-heads", type=int, default=8)
    ap.add_argument("--scale-dh", type=int, default=64)
    ap.add_argument("--max-t", type=int, default=8192, help="largest T in the scaling table")
    ap.add_argument("--cli", action="store_true", help=f"also run the CLI at {CLI_SHAPE} in a subprocess")
    ap.add_argument("--baseline", metavar="REV", help="compare this tree's ledger with the one at git revision REV")
    ap.add_argument("--rounds", type=int, default=21, help="alternating rounds per shape with --baseline")
    ap.add_argument("--workers", type=int, default=3, help="worker processes per side with --baseline")
    ap.add_argument("--max-slowdown", type=float, default=0.05,
                    help="with --baseline: exit 1 if a current median ratio exceeds the baseline's by more than this")
    ap.add_argument("--grad", action="store_true",
                    help=f"the --grad ledger against SDPA forward + backward at {GRAD_SHAPE}, with its peak memory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker()
    if args.workers < 1:
        print(f"error: --workers: got {args.workers}, expected at least 1", file=sys.stderr)
        return 2
    if args.baseline:
        return compare_with(args.baseline, args.rounds, args.max_slowdown, args.workers, args.shapes)
    if args.grad:
        from attn_ledger.alloc import retain_freed_memory

        retain_freed_memory()
        print(f"Machine: {machine(args.device)}; device {args.device}; causal float32; O-bar = 1; allocator: freed memory "
              f"retained (as the CLI); SDPA fwd+bwd, the --grad ledger and the forward ledger alternate, "
              f"{args.repeats} rounds after one warm-up; ratios are medians of the per-round ratios; peak RSS via "
              "/proc/self/clear_refs + VmHWM\n")
        return print_grad(bench_grad(GRAD_SHAPE, args.repeats, args.device))

    allocator = "C library default"
    if args.allocator == "retain":
        from attn_ledger.alloc import retain_freed_memory

        allocator = "freed memory retained (as the CLI)" if retain_freed_memory() else "C library default (no glibc)"
    print(f"Machine: {machine(args.device)}; device {args.device}; causal float32; allocator: {allocator}; "
          f"SDPA and ledger calls alternate, {args.repeats} rounds (at least {SHORT_REPEATS} for short shapes) after "
          f"one warm-up; ledger / SDPA is the median of the per-round ratios; peak RSS via /proc/self/clear_refs + VmHWM\n")
    if not args.skip_ratio:
        print("| (B, Nh, T, Dh) | SDPA ms | ledger ms | ledger / SDPA | SDPA peak RSS MiB (growth) | ledger peak RSS MiB (growth) |")
        print("|---|---:|---:|---:|---:|---:|")
        for shape in args.shapes:
            r = bench_shape(shape, args.repeats, args.device)
            print(f"| {_fmt_shape(shape)} | {r['sdpa_s'] * 1e3:.1f} | {r['ledger_s'] * 1e3:.1f} | {r['ratio']:.2f} "
                  f"| {r['sdpa_peak']:.0f} (+{r['sdpa_grow']:.0f}) | {r['ledger_peak']:.0f} (+{r['ledger_grow']:.0f}) |", flush=True)
        print()
    if not args.skip_scale:
        nh, dh = args.scale_heads, args.scale_dh
        print(f"Scaling, (1, {nh}, T, {dh}): time per T^2 relative to T = {SCALE_TS[0]} (1.00 = quadratic)\n")
        print("| T | SDPA ms | ledger ms | ledger / SDPA | SDPA / T^2 (rel.) | ledger / T^2 (rel.) | ledger peak RSS MiB (growth) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        base = None
        for t in [t for t in SCALE_TS if t <= args.max_t]:
            r = bench_shape((1, nh, t, dh), args.repeats, args.device)
            per = (r["sdpa_s"] / t**2, r["ledger_s"] / t**2)
            base = base or per
            print(f"| {t} | {r['sdpa_s'] * 1e3:.1f} | {r['ledger_s'] * 1e3:.1f} | {r['ratio']:.2f} | {per[0] / base[0]:.2f} "
                  f"| {per[1] / base[1]:.2f} | {r['ledger_peak']:.0f} (+{r['ledger_grow']:.0f}) |", flush=True)
        print()
    if args.cli:
        r = run_cli(CLI_SHAPE)
        print(f"CLI: `attn-ledger run --tensors qkv.safetensors --mask causal` at {_fmt_shape(CLI_SHAPE)} float32 "
              f"(inputs {3 * 4 * CLI_SHAPE[0] * CLI_SHAPE[1] * CLI_SHAPE[2] * CLI_SHAPE[3] / 2**30:.2f} GiB)\n")
        print("| run | wall s | peak RSS MiB | verdict |")
        print("|---|---:|---:|---|")
        print(f"| attn-ledger run --tensors (measured by {r['how']}) | {r['wall_s']:.1f} | {r['peak_mib']:.0f} | {r['verdict']} |")
        print(f"| SDPA alone, fresh process loading the same file | - | {r['sdpa_peak_mib']:.0f} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
