"""The allocator setting the command applies to its own process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attn_ledger import alloc

FAULTS = """
import json, resource, sys, torch
from attn_ledger import alloc
from attn_ledger.ledger import ledger_on_qkv
applied = alloc.retain_freed_memory() if sys.argv[1] == "retain" else False
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, 512, 64, generator=g) for _ in range(3))
for _ in range(3):
    ledger_on_qkv(q, k, v, mask="causal")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    ledger_on_qkv(q, k, v, mask="causal")
print(json.dumps({"applied": applied, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10}))
"""


def _faults_per_call(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retaining_freed_memory_stops_the_page_faults_of_each_call():
    retained, default = _faults_per_call("retain"), _faults_per_call("default")
    assert retained["applied"] is True
    # every call faults its block buffers in again (how many depends on the kernel's use of huge
    # pages: 600 to 2500 a call here); with freed memory retained, a small fraction of that
    assert default["faults"] > 200
    assert retained["faults"] < default["faults"] / 4


def test_off_linux_it_changes_nothing(monkeypatch):
    monkeypatch.setattr(alloc, "_applied", None)
    monkeypatch.setattr(alloc.sys, "platform", "darwin")
    assert alloc.retain_freed_memory() is False
    assert alloc.retain_freed_memory() is False  # remembered, not retried


def test_every_command_applies_it_before_building_its_report(monkeypatch):
    from attn_ledger.commands import common

    calls = []
    monkeypatch.setattr(alloc, "retain_freed_memory", lambda: calls.append("alloc") or True)

    def build():
        calls.append("build")
        raise common.AttnLedgerError("stop here")

    with pytest.raises(common.typer.Exit):
        common.execute(build, "json", None)
    assert calls == ["alloc", "build"]
