"""The ledger's engine, in layers that depend only downwards.

* :mod:`~attn_ledger.maths.relations`: the one parser and validator of mask relations, and
  the relation the ledger runs with, produced block by block;
* :mod:`~attn_ledger.engine.plan`: a pure, immutable plan from sizes and a relation: query
  blocks, key ranges and bands, the rows the float64 reference samples, SDPA groups;
* :mod:`~attn_ledger.engine.measure`: typed measurement records and the block-level
  measurements that produce them;
* :mod:`~attn_ledger.engine.execute`: runs a plan block by block through the stage
  functions and yields measurements;
* :mod:`~attn_ledger.engine.judge`: folds measurements over blocks and turns them into
  checks, under the one tolerance policy (:mod:`attn_ledger.tolerance`);
* :mod:`~attn_ledger.engine.grid`: the score-grid stages of one ledger, planned, executed
  and judged into rows;
* :mod:`~attn_ledger.engine.builtin`, :mod:`~attn_ledger.engine.positions`,
  :mod:`~attn_ledger.engine.properties`, :mod:`~attn_ledger.engine.replay`,
  :mod:`~attn_ledger.engine.backward` and :mod:`~attn_ledger.engine.backward_rows`: the
  built-in pipeline's other stages, rotary positions, boundary properties, replay and the
  backward, each filling its rows;
* :mod:`~attn_ledger.engine.assemble`: rows into the report, the first failing stage the finding.

:mod:`attn_ledger.ledger` orchestrates them into a ledger.
"""
