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

The function runs in the test's own process (so fixtures, closures and breakpoints work).
``sys.exit`` inside it is a finding, as in the CLI; there is no time limit unless
``timeout=`` is given, and that limit can stop Python code only (a hang inside C code
returns when the C code does; ``attn-ledger check`` runs the function in a worker process
for that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from attn_ledger.report import Report

__all__ = ["assert_attention_matches", "diagnosis"]


def assert_attention_matches(
    fn: Callable[..., Any],
    cases: Sequence[str] | str | None = None,
    *,
    empty_rows: str = "zeros",
    seed: int = 0,
    name: str | None = None,
    timeout: float | None = None,
) -> None:
    """Assert that ``fn`` passes every check on the default grid, or on the given case ids.

    Args:
        fn: the attention function (kernel protocol).
        cases: one case id or several (as printed by ``attn-ledger check``); None runs the default grid.
        empty_rows: the contract for a query with every key blocked: ``zeros``, ``nan`` or ``any``.
        seed: varies the random inputs and perturbations.
        name: how to name ``fn`` in the message (default: its module and qualified name).
        timeout: seconds per call of ``fn`` (None: no limit); a call past it fails its case
            with an L1 ``call`` finding. Needs the main thread (it uses ``SIGALRM``).

    Raises:
        AssertionError: some case fails; the message is the diagnosis.
        attn_ledger.errors.InputError: a malformed case id or contract.
    """
    from attn_ledger.guard import in_process
    from attn_ledger.kernelcheck import check_kernel, select_cases
    from attn_ledger.worker import check_timeout

    __tracebackhide__ = True  # pytest shows the diagnosis, not this frame
    check_timeout(timeout, "timeout")
    ids = [cases] if isinstance(cases, str) else cases
    target = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    with in_process(timeout):
        report = check_kernel(fn, select_cases(ids), target=target, empty_rows=empty_rows, seed=seed)
    if report.exit_code:
        raise AssertionError(diagnosis(report))


def diagnosis(report: "Report", max_cases: int = 3) -> str:
    """Plain text from a ``check`` report: the summary, the failing checks of the smallest failing
    cases (smallest first, at most ``max_cases``), and the lines that reproduce the smallest one."""
    from attn_ledger.kernelcheck import parse_case
    from attn_ledger.render.text import STATUS_WORD, describe

    d = report.details
    target = d["target"]
    name = target.rsplit(":", 1)[-1] if ":" in target else "attention"
    failing = sorted((r for r in report.rows if r.failing()), key=lambda r: (r.fields["elements"], r.name))
    if report.first_finding is None:
        return f"{target}: all {d['cases_total']} cases pass (empty rows: {d['empty_rows']})"
    first = report.first_finding
    lines = [f"{target}: {d['cases_failed']} of {d['cases_total']} cases fail; first level reached: "
             f"L{d['first_level']}; smallest failing case {first.row}: L{first.level} {first.name}"]
    lines += list(d["skipped"])
    for row in failing[:max_cases]:
        lines += ["", f"case {row.name}   {parse_case(row.name).call_text(name)}"]
        head = row.first_failing()
        for c in sorted(row.checks, key=lambda c: c is not head):  # the first failure first, then level order
            if c.failed or c.status in ("warn", "inconclusive"):
                mark = "FIRST" if c is head else STATUS_WORD[c.status]
                lines.append(f"  L{c.level} {c.name:<20} {mark:<12} {describe(c)}")
        if row.note:  # where index inputs decode the first wrong row's source
            lines.append(f"  {row.note}")
    if len(failing) > max_cases:
        lines.append(f"\n... and {len(failing) - max_cases} more failing cases")
    repro = d["reproduce"]
    lines += ["", "reproduce:", f"  {repro['cli']}"] + [f"  {ln}" for ln in repro["python"].splitlines()]
    return "\n".join(lines)
