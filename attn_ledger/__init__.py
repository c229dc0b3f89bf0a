"""attn-ledger: stage-by-stage diagnosis of attention code that runs but is wrong.

The library's entry points live in their modules (importing this package loads nothing
heavy): :mod:`attn_ledger.ledger` (``run_ledger``, ``ledger_on_qkv``, ``run_ledger_tensors``),
:mod:`attn_ledger.kernelcheck` and :mod:`attn_ledger.modulecheck` (``check``),
:mod:`attn_ledger.catalogue` (``faults``), :mod:`attn_ledger.experiments`, the report model
in :mod:`attn_ledger.report` and its views in :mod:`attn_ledger.render`.
"""

from attn_ledger._version import __version__

__all__ = ["__version__"]
