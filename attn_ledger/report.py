"""The one report model every command produces: checks, rows and a report, as data.

Nothing here formats for display: numbers stay numbers, and the sentences a reader sees
are rendered from the fields by :mod:`attn_ledger.render`. Every command builds a
:class:`Report`:

* a :class:`Check` is one invariant judged once: its level, name, :data:`Status`, the
  measured value, the limit (or the rtol/atol tolerance) it was judged against, where it
  was measured, and, only where no number says it, a reason in words;
* a :class:`Row` groups the checks of one stage (``run``), one case (``check``), one
  fault (``faults``), or one row of an experiment;
* a :class:`Report` holds the rows in order, and its :class:`Finding` headline: the first
  failing check, which every command's JSON carries as ``first_finding``;
* a :class:`Note` is a line (or a picture) a reader needs, held as data: what kind of
  line it is and the facts it is written from (the relation, the allowed counts, the call);
* a :class:`Hint` is what to try next, tested before it is said: a cheap alternative (another
  mask, another scale, a declaration) that explains the data. It sits under the first finding, or
  under a pass that rests on a recognised, undeclared design; it is never a verdict.

One status vocabulary (:data:`STATUSES`) and one verdict vocabulary (``pass``, ``fail``,
``error``) serve every command. ``error`` belongs to exit status 3 only: an internal
error of the tool, never a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping

SCHEMA_VERSION = 2

Status = Literal[
    "pass", "fail", "warn", "inconclusive", "skipped", "not_applicable", "not_reached", "downstream"
]
STATUSES: tuple[str, ...] = (
    "pass", "fail", "warn", "inconclusive", "skipped", "not_applicable", "not_reached", "downstream"
)
Verdict = Literal["pass", "fail", "error"]
Op = Literal["<=", ">=", "==", ""]
Unit = Literal["check", "row"]

LEVEL_NAMES = {1: "shape", 2: "axis semantics", 3: "numerical invariants", 4: "behaviour"}

# Statuses that mean the check was never judged on this input.
UNJUDGED = frozenset({"skipped", "not_applicable", "not_reached", "downstream"})


@dataclass(frozen=True)
class Check:
    """One invariant judged once.

    Attributes:
        level: 1 shape, 2 axis semantics, 3 numerical invariants, 4 behaviour.
        name: short stable identifier, e.g. ``key_row_sums``.
        status: one of :data:`STATUSES`.
        measure: what ``value`` is, in a few words (``"max |diff| vs float64"``,
            ``"values moved"``); empty when the check has no number.
        value: the measured number behind the status.
        limit: the bound ``value`` was judged against, read with ``op``.
        op: how ``value`` must relate to ``limit`` to pass: ``<=``, ``>=`` or ``==``.
        rtol, atol: an elementwise tolerance ``|a - b| <= atol + rtol * |b|``, where the
            bound is not one number.
        location: where the value was measured (``{"example": 1, "head": 0, "query": 3}``).
        reason: words, only where no number says it: what raised, why not applicable.
        data: further structured facts (lists, names) a machine may want.
    """

    level: int
    name: str
    status: Status
    measure: str = ""
    value: float | int | None = None
    limit: float | int | None = None
    op: Op = ""
    rtol: float | None = None
    atol: float | None = None
    location: Mapping[str, Any] | None = None
    reason: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: got {self.status!r}, expected one of {', '.join(STATUSES)}")
        if self.level not in LEVEL_NAMES:
            raise ValueError(f"level: got {self.level!r}, expected 1, 2, 3 or 4")

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def judged(self) -> bool:
        """True when the check was evaluated and gave pass, fail or warn."""
        return self.status in ("pass", "fail", "warn")

    def with_status(self, status: Status) -> "Check":
        return replace(self, status=status)


def bounded(level: int, name: str, measure: str, value: float | int, limit: float | int, *,
            op: Op = "<=", location: Mapping[str, Any] | None = None, reason: str = "",
            warn_only: bool = False, data: Mapping[str, Any] | None = None) -> Check:
    """A check whose status follows from ``value op limit`` (NaN never passes).

    ``warn_only`` turns a failure into ``warn``: shown, never a finding.
    """
    ok = _holds(value, op, limit)
    status: Status = "pass" if ok else ("warn" if warn_only else "fail")
    return Check(level, name, status, measure, value, limit, op, location=location, reason=reason,
                 data=dict(data or {}))


def counted(level: int, name: str, measure: str, count: int, *, location: Mapping[str, Any] | None = None,
            reason: str = "", data: Mapping[str, Any] | None = None) -> Check:
    """A check that passes when a counted violation never occurs (``count <= 0``)."""
    return bounded(level, name, measure, int(count), 0, location=location, reason=reason, data=data)


def unjudged(level: int, name: str, status: Status, reason: str) -> Check:
    """A check that was not judged (skipped, not applicable, not reached, inconclusive), with why."""
    return Check(level, name, status, reason=reason)


def _holds(value: float | int, op: Op, limit: float | int) -> bool:
    if value != value:  # NaN
        return False
    if op == "<=":
        return value <= limit
    if op == ">=":
        return value >= limit
    if op == "==":
        return value == limit
    raise ValueError(f"op: got {op!r}, expected '<=', '>=' or '=='")


@dataclass(frozen=True)
class Note:
    """A note as data: ``kind`` names the sentence (or picture) a renderer writes from ``data``.

    Attributes:
        kind: which note it is (``"allowed_keys"``, ``"relation_picture"``, ``"reproduce"``, ...);
            :func:`attn_ledger.render.notes.note_text` knows every kind.
        data: the facts, as plain values (numbers, lists, names), JSON-ready.
    """

    kind: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hint:
    """What to try next, as data: ``kind`` names the sentence :mod:`attn_ledger.render.hints` writes from ``data``.

    A hint is only made once its alternative was computed and found to explain the data (the
    saved ``out`` matches causal attention within the same bound, say). It changes no status.

    Attributes:
        kind: ``relation``, ``scale``, ``declare_softcap``, ``declare_window`` or ``alignment``.
        data: the facts, JSON-ready: what was declared, what explains the data, the option to try,
            and the measurement that showed it.
    """

    kind: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """One stage, case, fault or experiment row, with its checks in order.

    Attributes:
        name: the stage name, case id, fault name or row label.
        status: the row's status (``fail`` when it holds the failing check it is judged by).
        checks: its checks.
        shape, axes: the stage tensor's shape and what its axes mean (ledger rows).
        fields: further columns as plain values (numbers stay numbers).
        note: what a reader needs about this row: a :class:`Note`, or words.
    """

    name: str
    status: Status
    checks: tuple[Check, ...] = ()
    shape: tuple[int, ...] | None = None
    axes: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)
    note: str | Note = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: got {self.status!r}, expected one of {', '.join(STATUSES)}")

    def check(self, name: str) -> Check:
        return find_check(self.checks, name)

    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    def first_failing(self) -> Check | None:
        """The failing check at the lowest level (the first listed among equals)."""
        failing = self.failing()
        return min(failing, key=lambda c: c.level) if failing else None


@dataclass(frozen=True)
class Finding:
    """The headline: the first failing check, and the row it belongs to."""

    row: str
    check: Check

    @property
    def level(self) -> int:
        return self.check.level

    @property
    def name(self) -> str:
        return self.check.name


@dataclass(frozen=True)
class Coverage:
    """Where a verdict rests on fewer checks than usual, what it rests on and what could not run.

    Attributes:
        scope: a short name for what was checked (``"black-box"``, ``"partial"``).
        missing: names of the checks (or kinds of check) that could not run.
        reason: why.
    """

    scope: str
    missing: tuple[str, ...] = ()
    reason: str = ""


def find_check(checks: Iterable[Check], name: str) -> Check:
    """The check called ``name`` (KeyError if there is none)."""
    for c in checks:
        if c.name == name:
            return c
    raise KeyError(name)


def carry_diagnosis(checks: Iterable[Check], position: Mapping[str, int], matches: str, *,
                    keep_own: bool = False) -> tuple[Check, ...]:
    """The ``reference`` check's diagnosis, where it has one, carried to the first failing check too.

    Args:
        checks: one call's or case's checks.
        position: check name -> its place in the family's check order; the first failing check is
            the lowest level, then the lowest place.
        matches: what the diagnosis is said of, as the reason reads it: ``"the output matches"``.
        keep_own: leave a first failing check that holds a diagnosis of its own as it is.

    Returns:
        The checks in their order, the first failing one (where it is not the reference check) with
        the diagnosis in its data and ``"{matches} {diagnosis}"`` after its reason.
    """
    checks = tuple(checks)
    ref = next((c for c in checks if c.name == "reference"), None)
    failing = [c for c in checks if c.failed]
    if ref is None or "diagnosis" not in ref.data or not failing:
        return checks
    first = min(failing, key=lambda c: (c.level, position[c.name]))
    if first is ref or (keep_own and "diagnosis" in first.data):
        return checks
    said = "; ".join(r for r in (first.reason, f"{matches} {ref.data['diagnosis']}") if r)
    return tuple(replace(c, reason=said, data={**c.data, "diagnosis": ref.data["diagnosis"]}) if c is first else c
                 for c in checks)


def first_finding_of(rows: Iterable[Row]) -> Finding | None:
    """The first row (in order) with a failing check; within it, the lowest failing level."""
    for row in rows:
        first = row.first_failing()
        if first is not None:
            return Finding(row.name, first)
    return None


def row_status(checks: Iterable[Check]) -> Status:
    """A row's status from its checks: fail over warn over inconclusive over pass."""
    statuses = {c.status for c in checks}
    for s in ("fail", "warn", "inconclusive"):
        if s in statuses:
            return s  # type: ignore[return-value]
    if statuses and statuses <= UNJUDGED:
        return "skipped" if "skipped" in statuses else "not_applicable"
    return "pass"


_DEFAULT = object()


@dataclass(frozen=True)
class Report:
    """What every command hands to the renderers.

    Attributes:
        command: the command that produced it (``run``, ``check``, ``faults``, ...).
        title: one line naming what was examined.
        rows: in order; the first finding is the first failing check by row order.
        first_finding: the headline; computed from ``rows`` unless the command chooses one
            (``check`` names its smallest failing case).
        coverage: set where the verdict rests on fewer checks than usual.
        notes: lines a reader needs (sampling, reproduction, ...): :class:`Note` data, or words.
        hints: what to try next (:class:`Hint`), shown under the first finding.
        details: the command's own facts, JSON-ready (plain values only).
        unit: what one test case is in JUnit output: one ``check`` or one ``row``.
        row_label: what a row is called in tables (``stage``, ``case``, ``fault``, ...).
        show_passing: tables list passing checks of every row (the ledger), or only the
            checks that did not pass (reports over many cases).
        fold_rows: tables list only the rows that did not pass, one row for each distinct
            first finding (the first such row in order, with the count of the others), and
            count the rest (reports over hundreds of cases).
        heatmaps: what the heatmaps draw, as plain data (:class:`Heatmap` by kind, ``weights`` and
            ``mask``), taken from the kept grids when the report is built.
        tensors: small intermediates kept for inspection by library users (never rendered).
        ledger: another report this one opens onto: ``scan``'s stage ledger of its first wrong call,
            which every view shows after the report's own rows.
        ledgers: a report per row that each row opens onto (``scan --html``: every call's stage ledger),
            by row name; the HTML page shows them, under each row.
    """

    command: str
    title: str
    rows: tuple[Row, ...]
    first_finding: Finding | None = field(default=_DEFAULT)  # type: ignore[assignment]
    coverage: Coverage | None = None
    notes: tuple[str | Note, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    unit: Unit = "check"
    row_label: str = "row"
    show_passing: bool = True
    fold_rows: bool = False
    heatmaps: Mapping[str, Heatmap] = field(default_factory=dict, repr=False, compare=False)
    tensors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    hints: tuple[Hint, ...] = ()
    ledger: "Report | None" = field(default=None, repr=False, compare=False)
    ledgers: "Mapping[str, Report]" = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.first_finding is _DEFAULT:
            object.__setattr__(self, "first_finding", first_finding_of(self.rows))

    @property
    def verdict(self) -> Verdict:
        return "fail" if self.first_finding is not None else "pass"

    @property
    def exit_code(self) -> int:
        return 0 if self.first_finding is None else 1

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def check(self, row: str, name: str) -> Check:
        try:
            return self.row(row).check(name)
        except KeyError:
            raise KeyError(f"{row}.{name}") from None

    def checks(self) -> list[tuple[str, Check]]:
        """Every check with the name of its row, in order."""
        return [(r.name, c) for r in self.rows for c in r.checks]

    def warnings(self) -> list[tuple[str, Check]]:
        return [(r, c) for r, c in self.checks() if c.status == "warn"]

    def failures(self) -> list[tuple[str, Check]]:
        return [(r, c) for r, c in self.checks() if c.failed]


# Mask categories of a heatmap cell, in order of severity (a pooled cell shows the most severe of its cells).
MASK_CATEGORIES = ("forbidden", "allowed", "dropped", "leaked")
HEATMAP_LIMITS = range(4, 65)  # the cells a side a view may draw (terminal 4 to 32, HTML 64): one pooling each


@dataclass(frozen=True)
class HeatMark:
    """One failing check that points at cells (or whole query rows) of a heatmap's grid.

    Attributes:
        key: ``"stage.check"``, the check it stands for.
        rows: True when it points at whole query rows; False at (query, key) cells.
        count: marked cells (or rows) in the example drawn, over every head.
    """

    key: str
    rows: bool
    count: int


@dataclass(frozen=True)
class HeatLevel:
    """One example's grid, every head, pooled by ``(queries, keys)`` per drawn cell.

    ``values[h][i][j]``: the weight (``weights``) or an index into :data:`MASK_CATEGORIES`
    (``mask``); ``marked[h][i][j]``: the checks that point at the cell, as a set of bits (bit
    ``k`` set: ``Heatmap.marks[k]``); ``marked_rows[h][i]``: those that point at query row ``i``.
    """

    values: list[list[list[float]]]
    marked: list[list[list[int]]]
    marked_rows: list[list[int]]


@dataclass(frozen=True)
class Heatmap:
    """What a heatmap draws of one example, as plain data, at every pooling a view may ask for.

    Attributes:
        kind: ``weights`` or ``mask``.
        source: what the values are: ``weights``, ``given weights`` or ``mask``.
        example, examples: the example drawn, of how many.
        chosen: why this example: ``{"by": "finding", "row", "check"}``, ``{"by": "mark", "key"}``,
            ``{"by": "off_grid", "row", "check"}`` (the finding is on no score grid) or ``{"by": "none"}``.
        tq, tk: the grid's queries and keys.
        marks: the failing checks that point at cells of the example drawn.
        levels: the grid by ``(queries, keys)`` pooled into one cell; ``(1, 1)`` draws every cell.
        intended_only: mask: the pipeline's masked scores were not kept, only the relation is drawn.
    """

    kind: str
    source: str
    example: int
    examples: int
    chosen: Mapping[str, Any]
    tq: int
    tk: int
    marks: tuple[HeatMark, ...]
    levels: Mapping[tuple[int, int], HeatLevel]
    intended_only: bool = False
