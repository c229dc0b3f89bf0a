"""Put attn-ledger in your own test suite.

Example::

    from attn_ledger.testing import assert_attention_matches
    from mypkg.attn import attention

    def test_attention_follows_the_kernel_protocol():
        assert_attention_matches(attention)

The function is checked under the kernel protocol
(``attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)``, see
:mod:`attn_ledger.kernelcheck`). On any finding the ``AssertionError`` message is the
ledger's diagnosis: the first failing level and check per failing case, and the exact
command and Python call that reproduce the smallest one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["assert_attention_matches"]


def assert_attention_matches(
    fn: Callable[..., Any],
    cases: Sequence[str] | str | None = None,
    *,
    empty_rows: str = "zeros",
    seed: int = 0,
    name: str | None = None,
) -> None:
    """Assert that ``fn`` passes every check on the default grid, or on the given case ids.

    Args:
        fn: the attention function (kernel protocol).
        cases: one case id or several (as printed by ``attn-ledger check``); None runs the default grid.
        empty_rows: the contract for a query with every key blocked: ``zeros``, ``nan`` or ``any``.
        seed: varies the random inputs and perturbations.
        name: how to name ``fn`` in the message (default: its module and qualified name).

    Raises:
        AssertionError: some case fails; the message is the diagnosis.
        attn_ledger.errors.InputError: a malformed case id or contract.
    """
    from attn_ledger.kernelcheck import check_kernel, select_cases

    __tracebackhide__ = True  # pytest shows the diagnosis, not this frame
    ids = [cases] if isinstance(cases, str) else cases
    target = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    report = check_kernel(fn, select_cases(ids), target=target, empty_rows=empty_rows, seed=seed)
    if report.exit_code:
        raise AssertionError(report.diagnosis())
