"""Bounded work: the memory estimate against measured peaks, the headroom's sources, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.inputs import limits
from attn_ledger.engine import budget
from attn_ledger.cli import app
from attn_ledger.commands import options as opt
from attn_ledger.inputs.config import load_config
from attn_ledger.errors import InputError, ResourceError

runner = CliRunner()
ROOT = Path(__file__).parent.parent
GIB = 1 << 30


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_line(r) -> str:
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in r.output
    return err


# --- the estimate against the peak --------------------------------------------------------

# The peak of the process's anonymous resident memory (RssAnon, sampled every millisecond)
# over what it held after a warm-up run, at rising sizes, each peak above the last. Anonymous pages only: file-backed pages (torch's
# libraries) come and go with the machine's page cache, and there is no swap to take these.
MEASURE = """
import json, sys, threading, time
from attn_ledger.alloc import retain_freed_memory
from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import run_ledger
from attn_ledger.engine.budget import estimate_run

def anon():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

retain_freed_memory()  # as the command does
run_ledger(load_config(None, {"seq_len": 64, "embed_dim": 64, "num_heads": 4}))
base = anon()
threading.Thread(target=sample, daemon=True).start()
out = []
for over in json.loads(sys.argv[1]):  # rising sizes: each reuses the memory the last one freed and kept
    cfg = load_config(None, over)
    run_ledger(cfg)
    time.sleep(0.01)
    out.append({"config": over, "estimate": estimate_run(cfg).bytes, "peak": peak[0] - base})
print(json.dumps(out))
"""

SIZES = [  # a streamed score grid; projections and blocks together; a large batch with merge-stage comparisons
    {"seq_len": 4096, "embed_dim": 16, "num_heads": 1, "batch_size": 1},
    {"seq_len": 2048, "embed_dim": 512, "num_heads": 8, "batch_size": 1},
    {"seq_len": 512, "embed_dim": 128, "num_heads": 4, "batch_size": 64},
]


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_the_estimate_is_within_twice_the_measured_peak_at_three_sizes(grad):
    sizes = [{**size, "grad": True} if grad else size for size in SIZES]
    r = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(sizes)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    peaks = [row["peak"] for row in rows]
    assert peaks == sorted(peaks) and peaks[0] > 32 << 20, rows  # each size measured above the last one
    for row in rows:
        ratio = row["estimate"] / row["peak"]
        assert 0.5 <= ratio <= 2.0, row


# --- headroom ------------------------------------------------------------------------------

def fake_proc(tmp: Path, cgroup: str, meminfo_kib: int | None = None, vmsize_kib: int = 1000) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmSize:\t{vmsize_kib} kB\n")
    if meminfo_kib is not None:
        (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kib} kB\n")
    return proc


def test_cgroup_v2_headroom_is_the_least_room_over_the_cgroup_and_its_parents(tmp_path):
    proc = fake_proc(tmp_path, "0::/user.slice/job\n")
    root = tmp_path / "cg"
    (root / "user.slice" / "job").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "user.slice" / "memory.max").write_text(str(10 * GIB))
    (root / "user.slice" / "memory.current").write_text(str(9 * GIB))  # 1 GiB left in the parent
    (root / "user.slice" / "job" / "memory.max").write_text("max")  # no limit of its own
    (root / "user.slice" / "job" / "memory.current").write_text(str(GIB // 2))
    assert limits.cgroup_headroom(proc, root) == GIB
    (root / "user.slice" / "job" / "memory.max").write_text(str(GIB))
    assert limits.cgroup_headroom(proc, root) == GIB // 2


def test_cgroup_v1_headroom_and_its_no_limit_value(tmp_path):
    proc = fake_proc(tmp_path, "4:memory:/jobs/a\n0::/\n")
    root = tmp_path / "cg"
    d = root / "memory" / "jobs" / "a"
    d.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    (root / "memory" / "memory.usage_in_bytes").write_text(str(5 * GIB))
    assert limits.cgroup_headroom(proc, root) is None
    (d / "memory.limit_in_bytes").write_text(str(3 * GIB))
    (d / "memory.usage_in_bytes").write_text(str(GIB))
    assert limits.cgroup_headroom(proc, root) == 2 * GIB


def test_headroom_takes_the_smallest_source_or_the_stated_budget(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n", meminfo_kib=3 * (GIB >> 10))
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text(str(8 * GIB))
    (root / "memory.current").write_text(str(GIB))
    room = limits.headroom(proc=proc, cgroup_root=root)
    assert (room.bytes, room.source) == (3 * GIB, "MemAvailable")
    (root / "memory.current").write_text(str(6 * GIB))
    assert limits.headroom(proc=proc, cgroup_root=root).bytes == 2 * GIB
    assert limits.headroom(5 * GIB, proc=proc, cgroup_root=root).bytes == 5 * GIB


def test_address_space_limit_counts_against_the_current_vmsize():
    code = ("import resource; from attn_ledger import limits\n"
            "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))\n"
            "vm = limits._status_kib(limits.Path('/proc'), 'VmSize') * 1024\n"
            "room = limits.address_space_headroom()\n"
            "print(room, (8 << 30) - vm)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    room, expected = map(int, r.stdout.split())
    assert abs(room - expected) < 64 << 20  # VmSize read a moment apart


def test_parse_size():
    assert limits.parse_size("8G") == 8 * GIB
    assert limits.parse_size("512MiB") == 512 << 20
    assert limits.parse_size("1.5g") == 3 * GIB // 2
    assert limits.parse_size("1000") == 1000
    for bad in ("", "8X", "-1G", "0", "８G", "1e9"):
        with pytest.raises(InputError):
            limits.parse_size(bad)


# --- refusals and announcements -----------------------------------------------------------

def test_require_fits_names_the_estimate_and_the_headroom():
    est = limits.Estimate("a run", (("grids", 3 * GIB), ("weights", GIB)))
    with pytest.raises(ResourceError) as info:
        limits.require_fits(est, 2 * GIB)
    assert (info.value.needed, info.value.available) == (4 * GIB, 2 * GIB)
    assert limits.require_fits(est, 5 * GIB).bytes == 5 * GIB


@pytest.mark.parametrize("args", [
    ["--seq-len", "1000000000"],
    ["--embed-dim", "3000000000", "--heads", "1"],
    ["--value-dim", "5000000"],
    ["--batch-size", "100000", "--seq-len", "4096"],
])
def test_sizes_that_cannot_fit_are_refused_before_allocating(args):
    r = invoke("run", *args, "--max-memory", "4G")
    assert r.exit_code == 2
    err = one_line(r)
    assert "memory:" in err and "4.0 GiB available (--max-memory)" in err


def test_a_config_size_beyond_int64_is_refused_by_the_estimate(tmp_path):
    cfg = tmp_path / "huge.toml"
    cfg.write_text(f"embed_dim = {10**30}\nnum_heads = 1\n")
    r = invoke("run", str(cfg))
    assert r.exit_code == 2
    assert "memory:" in one_line(r)
    with pytest.raises(ResourceError) as info:
        limits.require_fits(budget.estimate_run(load_config(cfg)))
    assert info.value.needed > 10**60


def test_a_tight_budget_refuses_even_the_default_run():
    r = invoke("run", "--max-memory", "1K")
    assert r.exit_code == 2 and "1.0 KiB available (--max-memory)" in one_line(r)
    assert invoke("run", "--max-memory", "1G").exit_code == 0


def test_the_backward_is_counted_in_the_estimate(tmp_path):
    forward = budget.estimate_run(load_config(None, {"seq_len": 4096}))
    backward = budget.estimate_run(load_config(None, {"seq_len": 4096, "grad": True}))
    assert backward.bytes > forward.bytes and "--grad" in backward.what
    assert any(name.startswith("backward stages streaming") for name, _ in backward.parts)


def test_a_large_valid_request_is_announced_not_refused():
    said: list[str] = []
    est = budget.estimate_run(load_config(None, {"seq_len": 100000}))
    assert est.grid_entries == 2 * 3 * 100000 * 100000
    opt.guard(est, 64 * GIB, say=said.append)  # fits: not refused
    assert len(said) == 1 and said[0].startswith("estimate: ") and "6e+10 score-grid entries" in said[0]
    quiet: list[str] = []
    opt.guard(budget.estimate_run(load_config(None, {})), 64 * GIB, say=quiet.append)
    assert quiet == []


def test_tensor_files_are_sized_before_they_are_read(tmp_path):
    import numpy as np

    path = tmp_path / "big.npz"
    np.savez_compressed(path, q=np.zeros((4096, 4096)))  # 128 MiB of zeros, a small file
    assert path.stat().st_size < 1 << 20
    r = invoke("run", "--tensors", str(path), "--max-memory", "64M")
    assert r.exit_code == 2
    assert "loading" in one_line(r) and "64.0 MiB available" in r.stderr


def test_sweep_and_module_sizes_are_guarded():
    r = invoke("sweep-scale", "--dh", "8", "--queries", "4096", "--keys", "4096", "--max-memory", "100M")
    assert r.exit_code == 2 and "memory:" in one_line(r)
    r = invoke("check", "--module", "fixtures/modules/attention_modules.py:causal_mha", "--embed-dim", "100000", "--heads", "1",
               "--max-memory", "1G")
    assert r.exit_code == 2 and "memory:" in one_line(r)
    r = invoke("intervene", "--seq-len", "100000", "--max-memory", "1G")
    assert r.exit_code == 2 and "memory:" in one_line(r)


def test_memory_option_is_strict():
    r = invoke("run", "--max-memory", "lots")
    assert r.exit_code == 2 and "--max-memory" in one_line(r)


def test_no_limit_readable_means_no_refusal(tmp_path):
    proc = tmp_path / "empty"
    proc.mkdir()
    if os.name == "posix":
        room = limits.headroom(proc=proc, cgroup_root=tmp_path / "none")
        assert room.source in ("no memory limit readable", "RLIMIT_AS less VmSize")
