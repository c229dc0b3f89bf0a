"""Whole models: every attention call of one forward, observed in place and judged against the model's config.

``targets`` says what model is scanned and builds it (in the worker); ``inputs`` makes the token ids,
padding and position ids the forward runs on; ``capture`` watches the forward through the model's own
attention interface (or the function-mode observer where a call bypasses it); ``expect`` reads what
each call should compute from the config; ``judge`` checks one call; ``scan`` turns the calls into a
report. The parent judges: only ``capture`` and the worker's side of ``driver`` run the model.
"""
