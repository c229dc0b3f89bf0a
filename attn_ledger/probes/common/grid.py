"""Case grids the probe families share: a case with its tier and reason, axes combined pairwise, tiers
put together without repeats, and the ``--list-cases`` entries.

A family's case type is its own (:class:`attn_ledger.probes.kernel.cases.Case`,
:class:`attn_ledger.probes.interface.cases.ICase`); what is shared only reads its ``id`` and ``size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class GridCase:
    """A case of a tier and the reason it is there."""

    case: Any
    tier: str
    reason: str


def pairwise(axes: Mapping[str, Sequence[Any]], valid: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Assignments of the axes that together hold every allowed pair of values of two axes.

    Greedy and deterministic: each new assignment starts from the first pair not yet held and
    fills the other axes, in order, with the value that holds the most new pairs, backtracking
    where ``valid`` (called on partial assignments) refuses. A pair no valid assignment can hold
    is dropped. Far fewer assignments than the full cross: about the product of the two largest axes.
    """
    names = list(axes)
    todo = {(a, i, b, j) for ai, a in enumerate(names) for b in names[ai + 1:]
            for i in range(len(axes[a])) for j in range(len(axes[b]))}

    def value(pick: dict[str, int]) -> dict[str, Any]:
        return {n: axes[n][i] for n, i in pick.items()}

    def gain(pick: dict[str, int], name: str, i: int) -> int:
        n = 0
        for other, j in pick.items():
            a, b = sorted((name, other), key=names.index)
            key = (a, i, b, j) if a == name else (a, j, b, i)
            n += key in todo
        return n

    def complete(pick: dict[str, int], rest: list[str]) -> dict[str, int] | None:
        if not rest:
            return pick
        name = rest[0]
        order = sorted(range(len(axes[name])), key=lambda i: -gain(pick, name, i))
        for i in order:
            trial = {**pick, name: i}
            if valid(value(trial)):
                done = complete(trial, rest[1:])
                if done is not None:
                    return done
        return None

    out: list[dict[str, Any]] = []
    while todo:
        a, i, b, j = min(todo, key=lambda t: (names.index(t[0]), t[1], names.index(t[2]), t[3]))
        start = {a: i, b: j}
        pick = complete(start, [n for n in names if n not in start]) if valid(value(start)) else None
        if pick is None:
            todo.discard((a, i, b, j))
            continue
        for ai, x in enumerate(names):
            for y in names[ai + 1:]:
                todo.discard((x, pick[x], y, pick[y]))
        out.append(value({n: pick[n] for n in names}))
    return out


def with_new(first: Sequence[GridCase], then: Iterable[GridCase]) -> tuple[GridCase, ...]:
    """``first`` as it is, then each case of ``then`` whose id is not already there (the earlier entry
    keeps its tier and reason)."""
    seen = {g.case.id for g in first}
    out = list(first)
    for g in then:
        if g.case.id not in seen:
            seen.add(g.case.id)
            out.append(g)
    return tuple(out)


def describe_tiers(cases: Iterable[GridCase]) -> list[dict[str, Any]]:
    """``--list-cases``: id, tier, reason and size of each case."""
    return [{"id": g.case.id, "tier": g.tier, "reason": g.reason, "elements": g.case.size} for g in cases]
