"""Put attn-ledger in your own test suite.

Example::

    from attn_ledger.testing import assert_attention_matches, assert_module_matches
    from mypkg.attn import attention, make_attention

    def test_attention_follows_the_kernel_protocol():
        assert_attention_matches(attention)

    def test_attention_module():
        assert_module_matches(make_attention, embed_dim=64, num_heads=4, window=16, seq_len=24)

    def test_every_attention_call_of_my_model():
        assert_model_attention_ok(model, {"input_ids": ids, "attention_mask": mask})

    def test_my_attention_function_agrees_with_eager():
        assert_models_agree(eager_model, model_with_my_function)

A function is checked under the kernel protocol
(``attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)``, see
:mod:`attn_ledger.probes.kernel.check`), on the default tier unless told otherwise, with what the
kernel supports read from ``[tool.attn-ledger.check]`` in the ``pyproject.toml`` of pytest's
rootdir (the table ``attn-ledger check`` reads; the helper's arguments override it); a module
factory under the module protocol
(``factory(embed_dim, num_heads) -> nn.Module``, ``[B, T, E] -> [B, T, E]``, see
:mod:`attn_ledger.probes.module.check`). On any finding the ``AssertionError`` message is the
diagnosis: the first failing level and check (per failing case, for kernels), what else
failed or could not be judged, and the exact command and Python call that reproduce it.

The code under test runs in the test's own process (so fixtures, closures and breakpoints
work). ``sys.exit`` inside it is a finding, as in the CLI; there is no time limit unless
``timeout=`` is given, and that limit can stop Python code only (a hang inside C code
returns when the C code does; ``attn-ledger check`` runs user code in a worker process
for that). By design the helpers are exempt from the separation of judge and judged that
``attn-ledger check`` keeps (the tool's process judges, a worker only calls the code): code
under test here shares a torch with its judge, so patching torch or the tool can fake a result.
"""

from __future__ import annotations

import warnings
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from attn_ledger.report import Report

__all__ = ["InconclusiveCases", "assert_attention_matches", "assert_model_attention_ok", "assert_models_agree",
           "assert_module_matches", "compare_diagnosis", "diagnosis", "model_diagnosis", "module_diagnosis", "rootdir"]


class InconclusiveCases(UserWarning):
    """Every case passes or is inconclusive, and some are inconclusive: nothing past L1 judged them."""


def rootdir() -> Path:
    """pytest's rootdir when the attn-ledger pytest plugin saw the session start; else the nearest
    directory at or above the current one that holds a ``pyproject.toml`` (else the current one)."""
    from attn_ledger import pytest_plugin

    if pytest_plugin.ROOTDIR is not None:
        return Path(pytest_plugin.ROOTDIR)
    here = Path.cwd()
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file():
            return d
    return here


def assert_attention_matches(  # long by its documented arguments; the code is under 20 lines
    fn: Callable[..., Any],
    cases: Sequence[str] | str | None = None,
    *,
    tier: str = "default",
    empty_rows: str | None = None,
    seed: int = 0,
    name: str | None = None,
    timeout: float | None = None,
    backward: bool | None = None,
    strict_precision: bool | None = None,
    strict_coverage: bool | None = None,
    device: str = "cpu",
    dtypes: Sequence[str] | None = None,
    masks: Sequence[str] | None = None,
    gqa: bool | None = None,
    distinct_dv: bool | None = None,
    max_tq: int | None = None,
    max_tk: int | None = None,
    head_dims: Sequence[int] | None = None,
    supports: Sequence[str] | None = None,
    protocol: str | None = None,
) -> None:
    """Assert that ``fn`` passes every check on a tier of cases, or on the given case ids.

    Args:
        fn: the attention function (kernel protocol).
        cases: one case id or several (as printed by ``attn-ledger check``); None runs the ``tier``.
        tier: ``default`` or ``full``.
        empty_rows: the contract for a query with every key blocked: ``zeros``, ``nan``, ``finite`` (any
            finite row; NaN or inf fails) or ``any`` (None: the pyproject table's, else ``zeros``).
        seed: varies the random inputs and perturbations.
        name: how to name ``fn`` in the message (default: its module and qualified name).
        timeout: seconds per call of ``fn`` (None: no limit); a call past it fails its case
            with an L1 ``call`` finding. Needs the main thread (it uses ``SIGALRM``).
        backward: check gradients (None: the table's, else True).
        strict_precision: a float64 case at float32 precision fails (None: the table's, else False).
        strict_coverage: a case that no check past L1 judged fails (None: the table's, else False: such
            a case is counted inconclusive, and the helper warns with :class:`InconclusiveCases`).
        device: ``cpu``, ``cuda``, ``mps`` or ``auto``.
        dtypes, masks, gqa, distinct_dv, max_tq, max_tk, head_dims: what the kernel supports (None: the
            table's, else everything); cases outside are skipped.
        supports: the optional features it takes (``softcap``, ``window``, ``sinks``; None: the table's,
            else none): each adds the cases that exercise it.
        protocol: ``kernel`` or ``transformers`` (a function for transformers' ``AttentionInterface``,
            ``fn(module, query, key, value, attention_mask, ...)``); None: detected from the signature.
            Under ``transformers``, ``masks`` names the mask functions (``sdpa``, ``eager``, ``none``,
            ``flex``), ``empty_rows`` defaults to ``finite``, and only ``cases``, ``tier``, ``seed``, ``name``,
            ``empty_rows``, ``dtypes``, ``masks`` and ``supports`` apply.

    Warns:
        InconclusiveCases: no case fails, but some case was judged by nothing past L1.

    Raises:
        AssertionError: some case fails; the message is the diagnosis.
        attn_ledger.errors.InputError: a malformed case id, contract or declaration.
        attn_ledger.errors.SetupError: ``fn`` cannot take the protocol's arguments.
    """
    from attn_ledger.guard import in_process
    from attn_ledger.probes.kernel.check import check_kernel, select_cases
    from attn_ledger.probes.kernel.spec import from_sources
    from attn_ledger.runner.worker import check_timeout

    __tracebackhide__ = True  # pytest shows the diagnosis, not this frame
    check_timeout(timeout, "timeout")
    if _is_interface(fn, protocol):
        _assert_interface(fn, cases, empty_rows=empty_rows, seed=seed, name=name, timeout=timeout,
                          dtypes=dtypes, masks=masks, supports=supports, tier=tier)
        return
    declared = {"dtypes": dtypes, "masks": masks, "gqa": gqa, "distinct_dv": distinct_dv, "max_tq": max_tq,
                "max_tk": max_tk, "head_dims": head_dims, "backward": backward, "supports": supports,
                "empty_rows": empty_rows,
                "strict_precision": strict_precision, "strict_coverage": strict_coverage}
    decl, run = from_sources(declared, rootdir())
    ids = [cases] if isinstance(cases, str) else cases
    target = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    with in_process(timeout):
        report = check_kernel(fn, select_cases(ids, tier) if ids else None, tier=tier, target=target,
                              empty_rows=run.get("empty_rows", "zeros"), seed=seed, backward=decl.backward,
                              strict_precision=run.get("strict_precision", False), device=device, declaration=decl,
                              strict_coverage=run.get("strict_coverage", False))
    if report.exit_code:
        raise AssertionError(diagnosis(report))
    if report.details["cases_inconclusive"]:
        warnings.warn(InconclusiveCases(diagnosis(report)), stacklevel=2)


def _is_interface(fn: Callable[..., Any], protocol: str | None) -> bool:
    import inspect

    from attn_ledger.errors import InputError
    from attn_ledger.probes.interface.check import is_interface

    if protocol not in (None, "kernel", "transformers"):
        raise InputError(f"protocol: got {protocol!r}, expected kernel or transformers")
    if protocol is not None:
        return protocol == "transformers"
    try:
        return is_interface(inspect.signature(fn))
    except (TypeError, ValueError):
        return False


def _assert_interface(fn: Callable[..., Any], cases: Sequence[str] | str | None, *, empty_rows: str | None,
                      seed: int, name: str | None, timeout: float | None, dtypes: Sequence[str] | None,
                      masks: Sequence[str] | None, supports: Sequence[str] | None, tier: str = "default") -> None:
    """:func:`assert_attention_matches` under the transformers protocol (``[tool.attn-ledger.check]`` read too)."""
    from attn_ledger.guard import in_process
    from attn_ledger.probes.interface.check import check_interface, declaration
    from attn_ledger.probes.kernel.spec import TABLE, read_table

    __tracebackhide__ = True
    table = read_table(rootdir())
    keys = ("masks", "dtypes", "supports")
    given = {"masks": masks, "dtypes": dtypes, "supports": supports}
    values = {**{k: table[k] for k in keys if k in table}, **{k: v for k, v in given.items() if v is not None}}
    decl = declaration(values, source=f"[{TABLE}] ")
    ids = [cases] if isinstance(cases, str) else cases
    target = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    with in_process(timeout):
        report = check_interface(fn, ids, target=target, declaration=decl, seed=seed, tier=tier,
                                 empty_rows=empty_rows or table.get("empty_rows", "finite"))
    if report.exit_code:
        raise AssertionError(interface_diagnosis(report))


def interface_diagnosis(report: "Report") -> str:
    """Plain text from a ``check --protocol transformers`` report: the count, the first finding, its reproduction."""
    from attn_ledger.render.notes import interface_reproduce_lines
    from attn_ledger.render.text import describe

    d, first = report.details, report.first_finding
    if first is None:
        return f"{d['target']}: all {d['cases_total']} cases pass (transformers protocol)"
    return "\n".join([f"{d['target']}: {d['cases_failed']} of {_cases(d['cases_total'])} fail (transformers protocol); "
                      f"smallest failing case {first.row}: L{first.level} {first.name}: {describe(first.check)}",
                      *(f"  {ln}" for ln in interface_reproduce_lines(d["reproduce"]))])


def diagnosis(report: "Report", max_cases: int = 3) -> str:
    """Plain text from a ``check`` report: the summary, each distinct failure once (with its count and
    smallest case), the failing checks of the smallest failing cases of different failures (at most
    ``max_cases``), and the lines that reproduce the smallest one."""
    from attn_ledger.probes.kernel.check import parse_case
    from attn_ledger.render.notes import cli_line, note_text, python_lines
    from attn_ledger.render.text import STATUS_WORD, describe

    d = report.details
    target = d["target"]
    fn_name = target.rsplit(":", 1)[-1] if ":" in target else "attention"
    skipped = f"; {d['cases_skipped']} skipped (outside the declaration)" if d.get("cases_skipped") else ""
    if report.first_finding is None:
        if not d["cases_inconclusive"]:
            return f"{target}: all {d['cases_total']} cases pass{skipped} (empty rows: {d['empty_rows']})"
        passed = d["cases_total"] - d["cases_inconclusive"]
        return "\n".join([f"{target}: {passed} of {_cases(d['cases_total'])} {'passes' if passed == 1 else 'pass'}, "
                          f"{d['cases_inconclusive']} inconclusive{skipped} (empty rows: {d['empty_rows']})",
                          f"  no check past L1 judged {_cases(d['cases_inconclusive'])} (smallest "
                          f"{d['smallest_inconclusive']}); strict_coverage=True makes them failures"])
    first = report.first_finding
    verb = "fails" if d["cases_failed"] == 1 else "fail"
    lines = [f"{target}: {d['cases_failed']} of {_cases(d['cases_total'])} {verb}{skipped}; first level reached: "
             f"L{d['first_level']}; smallest failing case {first.row}: L{first.level} {first.name}"]
    lines += [note_text(n) for n in d["skipped"]]
    for g in d["failures"]:
        lines.append(f"  L{g['level']} {g['check']} fails first in {_cases(g['cases'])} (smallest {g['smallest_case']})")
    shown = [g["smallest_case"] for g in sorted(d["failures"], key=lambda g: (parse_case(g["smallest_case"]).size,
                                                                              g["smallest_case"]))]
    for case_id in shown[:max_cases]:
        row = report.row(case_id)
        lines += ["", f"case {row.name}   {parse_case(row.name).call_text(fn_name)}"]
        head = row.first_failing()
        for c in sorted(row.checks, key=lambda c: c is not head):  # the first failure first, then level order
            if c.failed or c.status in ("warn", "inconclusive"):
                mark = "FIRST" if c is head else STATUS_WORD[c.status]
                lines.append(f"  L{c.level} {c.name:<20} {mark:<12} {describe(c)}")
        if row.note:  # where index inputs decode the first wrong row's source
            lines.append(f"  {note_text(row.note)}")
    if len(shown) > max_cases:
        lines.append(f"\n... and {len(shown) - max_cases} more distinct failures")
    repro = d["reproduce"]
    lines += ["", "reproduce:", f"  {cli_line(repro)}"] + [f"  {ln}" for ln in python_lines(repro)]
    return "\n".join(lines)


def _cases(n: int) -> str:
    return f"{n} case" if n == 1 else f"{n} cases"


def assert_module_matches(
    factory: Callable[..., Any],
    embed_dim: int,
    num_heads: int,
    *,
    batch_size: int = 2,
    seq_len: int = 6,
    name: str | None = None,
    timeout: float | None = None,
    **declared: Any,
) -> None:
    """Assert that the module ``factory(embed_dim, num_heads)`` builds passes every module check.

    Args:
        factory: ``factory(embed_dim, num_heads) -> nn.Module`` mapping ``[B, T, E]`` to ``[B, T, E]``.
        embed_dim, num_heads: E and Nh, passed to the factory.
        batch_size, seq_len: the inputs (B >= 2, T >= 2).
        declared: ``causal``, ``window``, ``scale``, ``softcap``: what the module is meant to compute
            (causal or not, a causal sliding window of ``window`` keys, its own softmax scale, a soft-cap
            on its scores), and ``seed``; as :func:`~attn_ledger.probes.module.check.check_module` takes them,
            with its defaults (causal, no window, 1/sqrt(Dh), no cap, seed 0).
        name: how to name the factory in the message and the command (default
            ``path/to/file.py:QUALNAME`` where the factory can be imported that way).
        timeout: seconds per call into the module (None: no limit); a call past it stops the
            check with an L1 ``call`` finding. Needs the main thread (it uses ``SIGALRM``).

    Raises:
        AssertionError: some check fails; the message is the diagnosis with its reproduction.
        attn_ledger.errors.InputError: sizes or declarations out of range.
        attn_ledger.errors.SetupError: the factory raised or returned no module.
    """
    from attn_ledger.guard import in_process
    from attn_ledger.probes.module.check import check_module
    from attn_ledger.runner.worker import check_timeout

    __tracebackhide__ = True  # pytest shows the diagnosis, not this frame
    check_timeout(timeout, "timeout")
    spec = name or _factory_spec(factory)
    options = {**_declaration(declared), "batch_size": batch_size, "seq_len": seq_len}
    with in_process(timeout):
        report = check_module(factory, embed_dim, num_heads, subject=spec, **options)
    if report.exit_code:
        raise AssertionError(module_diagnosis(report, reproduce=_module_reproduction(spec, embed_dim, num_heads, options)))


DECLARED = ("causal", "window", "scale", "softcap", "seed")  # what assert_module_matches passes on as check_module's keywords


def _declaration(declared: dict[str, Any]) -> dict[str, Any]:
    """``declared`` over :func:`~attn_ledger.probes.module.check.check_built_module`'s defaults, in :data:`DECLARED` order."""
    import inspect

    from attn_ledger.probes.module.check import check_built_module

    unknown = sorted(set(declared) - set(DECLARED))
    if unknown:
        raise TypeError(f"assert_module_matches() got an unexpected keyword argument {unknown[0]!r}")
    params = inspect.signature(check_built_module).parameters
    return {k: declared.get(k, params[k].default) for k in DECLARED}


def _factory_spec(factory: Callable[..., Any]) -> str:
    """``path/to/file.py:QUALNAME`` when the factory can be found that way, else its qualified name."""
    import inspect

    qualname = getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or repr(factory)
    try:
        path = inspect.getsourcefile(factory)
    except TypeError:
        path = None
    if path and "<" not in qualname and "." not in qualname:
        return f"{path}:{qualname}"
    return f"{getattr(factory, '__module__', '?')}:{qualname}"


def _module_reproduction(spec: str, embed_dim: int, num_heads: int, options: dict[str, Any]) -> dict[str, str]:
    cli = [f"attn-ledger check --module {shlex.quote(spec)} --embed-dim {embed_dim} --heads {num_heads}"]
    if not options["causal"]:
        cli.append("--no-causal")
    if options["window"] is not None:
        cli.append(f"--window {options['window']}")
    if options["scale"] is not None:
        cli.append(f"--scale {options['scale']!r}")
    if options.get("softcap") is not None:
        cli.append(f"--softcap {options['softcap']!r}")
    cli.append(f"--seed {options['seed']} --batch-size {options['batch_size']} --seq-len {options['seq_len']}")
    args = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "softcap" or v is not None)
    python = ("from attn_ledger.probes.module.check import check_module\n"
              f"report = check_module(factory, {embed_dim}, {num_heads}, {args})\n"
              "print(report.first_finding)")
    return {"cli": " ".join(cli), "python": python}


def module_diagnosis(report: "Report", reproduce: dict[str, str] | None = None) -> str:
    """Plain text from a ``check --module`` report: the first finding, every check that failed,
    warned or could not be judged, what was observed, the coverage, and the reproduction."""
    from attn_ledger.render.notes import notes_text
    from attn_ledger.render.text import STATUS_WORD, describe

    d = report.details
    first = report.first_finding
    if first is None:
        head = f"{d['subject']}: every module check passes"
    else:
        head = (f"{d['subject']}: module check fails; first finding: {first.row} "
                f"L{first.level} {first.name}: {describe(first.check)}")
    lines = [head]
    for row, c in report.checks():
        if c.failed or c.status in ("warn", "inconclusive"):
            mark = "FIRST" if first is not None and c is first.check else STATUS_WORD[c.status]
            lines.append(f"  {row:<11} L{c.level} {c.name:<28} {mark:<12} {describe(c)}")
    lines += [f"  {n}" for n in notes_text(report)]
    if report.coverage is not None:
        lines.append(f"  coverage: {report.coverage.scope}: {report.coverage.reason}")
    if reproduce:
        lines += ["", "reproduce:", f"  {reproduce['cli']}"] + [f"  {ln}" for ln in reproduce["python"].splitlines()]
    return "\n".join(lines)


def assert_model_attention_ok(model: Any, inputs: Any = None, *, timeout: float | None = None, **options: Any) -> None:
    """Assert that every attention call of one forward of ``model`` computes what its config (or a declaration) implies.

    Args:
        model: an ``nn.Module``: a transformers model (judged against its config) or one of your own (judged against
            ``causal``, ``window``, ``scale``, ``softcap``).
        inputs: the forward's keyword arguments or its tensor; None makes token ids for a transformers model.
        timeout: seconds for the forward (None: no limit; needs the main thread).
        options: :func:`attn_ledger.probes.model.scan.scan_model`'s: ``batch``, ``seq_len``, ``padding``, ``seed``,
            ``causal``, ``window``, ``scale``, ``softcap``, ``keep_going``, ``label``.

    Raises:
        AssertionError: a call is wrong; the message names the first wrong call, its diagnosis, and the stage
            ledger's first finding on its tensors.
    """
    from attn_ledger.guard import in_process
    from attn_ledger.probes.model.scan import scan_model
    from attn_ledger.runner.worker import check_timeout

    __tracebackhide__ = True  # pytest shows the diagnosis, not this frame
    check_timeout(timeout, "timeout")
    with in_process(timeout):
        report = scan_model(model, inputs, **options)
    if report.exit_code:
        raise AssertionError(model_diagnosis(report))


def model_diagnosis(report: "Report") -> str:
    """Plain text from a ``scan`` report: the first wrong call and why, the other calls' statuses, the notes, and
    the stage ledger's first finding on that call's tensors."""
    from attn_ledger.render.notes import notes_text
    from attn_ledger.render.text import STATUS_WORD, describe, finding_line

    first = report.first_finding
    lines = [f"{report.title}: " + ("every attention call holds" if first is None else
                                     f"first wrong call {first.row}: L{first.level} {first.name}: {describe(first.check)}")]
    for row in report.rows:
        bad = row.first_failing()
        lines.append(f"  {row.name:<32} {STATUS_WORD[row.status]:<12}" + (f" L{bad.level} {bad.name}" if bad else ""))
    lines += [f"  {n}" for n in notes_text(report)]
    if report.coverage is not None:
        lines.append(f"  coverage: {report.coverage.scope}: {report.coverage.reason}")
    if report.ledger is not None:
        lines.append(f"  stage ledger of {first.row if first else 'the call'}: {finding_line(report.ledger.first_finding)}")
    return "\n".join(lines)


def assert_models_agree(a: Any, b: Any, inputs: Any = None, *, timeout: float | None = None, **options: Any) -> None:
    """Assert that two runs of one transformers model agree block by block, as ``attn-ledger compare`` judges them.

    Args:
        a: run A, the reference model.
        b: run B: the same model, with the same weights, run another way (another attention implementation, a
            registered function, another dtype).
        inputs: ``input_ids`` and ``attention_mask`` (and ``position_ids``) for both runs; None makes token ids.
        timeout: seconds for the forwards (None: no limit; needs the main thread).
        options: :func:`attn_ledger.probes.model.compare.compare_models`'s: ``batch``, ``seq_len``, ``padding``,
            ``seed``, ``label``, ``cache`` (B decoded token by token through its own cache, A the full forward).

    Raises:
        AssertionError: a row fails; the message names the first block that adds error beyond its bound (or the
            model-level row), the numbers, and what the stage ledger of that block's attention found in each run.
    """
    from attn_ledger.guard import in_process
    from attn_ledger.probes.model.compare import compare_models
    from attn_ledger.runner.worker import check_timeout

    __tracebackhide__ = True  # pytest shows the diagnosis, not this frame
    check_timeout(timeout, "timeout")
    with in_process(timeout):
        report = compare_models(a, b, inputs, **options)
    if report.exit_code:
        raise AssertionError(compare_diagnosis(report))


def compare_diagnosis(report: "Report") -> str:
    """Plain text from a ``compare`` report: the first failing row and why, every row's numbers, the notes, and the
    stage ledger's first finding on the first adder's attention."""
    from attn_ledger.render.notes import notes_text
    from attn_ledger.render.text import STATUS_WORD, describe, finding_line, fmt_value

    first = report.first_finding
    lines = [f"{report.title}: " + ("the runs agree" if first is None else
                                     f"first finding {first.row}: L{first.level} {first.name}: {describe(first.check)}")]
    for row in report.rows:
        nums = "  ".join(f"{k} {fmt_value(row.fields[k])}" for k in ("total", "added", "bound")
                         if row.fields.get(k) is not None)
        mark = f"  ({row.fields['mark']})" if row.fields.get("mark") else ""
        lines.append(f"  {row.name:<24} {STATUS_WORD[row.status]:<12} {nums}{mark}")
    lines += [f"  {n}" for n in notes_text(report)]
    if report.ledger is not None and report.ledger.first_finding is not None:
        lines.append(f"  stage ledger of the first adder's attention: {finding_line(report.ledger.first_finding)}")
    return "\n".join(lines)
