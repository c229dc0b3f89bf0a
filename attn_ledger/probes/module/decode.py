"""KV-cache decode parity of an attention module: ``check --module FILE:FACTORY --decode FILE:NAME``.

The decode protocol: ``decode(module, x_new, cache) -> (y_new, cache)``. ``x_new`` and ``y_new``
are ``[B, t, E]`` (t >= 1 new tokens); ``cache`` is None on a sequence's first call and
otherwise whatever the previous call returned (the tool never looks inside it). The module is
in eval mode and every call runs under ``torch.no_grad()``.

Each scenario (:func:`plan_scenarios`) decodes a sequence of T positions from an empty cache in
chunks, and every decoded position is compared with the module's full causal forward on the
whole sequence, within the dtype's tolerance of the forward's largest |y|
(:func:`attn_ledger.tolerance.relative`, torch.testing.assert_close's atol + rtol):

* ``tokens``: one token per call, which is also a prefill of 1 followed by single tokens;
* ``chunks``: chunks of 3 and 4 tokens in turn (the first one is the prefill);
* ``prefill_5``, ``prefill_17``: a prefill of an odd length and of a length past a block of 16,
  then single tokens;
* ``two_sequences``: two sequences, one token per call, calls interleaved, a cache each.

Where a scenario disagrees, :func:`diagnose` names the pattern from outside, by experiments on
the user's own code (:data:`DIAGNOSES`):

1. ``state_shared``: the same calls on the same inputs, rerun from an empty cache, give other
   outputs; or a sequence that disagrees when decoded beside another agrees when decoded alone.
2. ``positions_offset``: the decode output is the full forward's output at another position;
   or the q and k entering attention (observed under a torch function mode, at a
   ``scaled_dot_product_attention`` call or the first batched matmul) sit at other positions
   than in the full forward. Positions are read off a table built by one forward on sequences
   of one token repeated, which gives each token's q and k at every position; rotary
   positions are named by :func:`attn_ledger.maths.rotary.recognise_rotary` on that table.
3. ``cache_one_short`` / ``cache_one_long``: the observed keys are the expected ones less one,
   or with one twice; or the output is the full forward's on the sequence with a token removed
   or duplicated (exact where positions are relative or absent); or one past key, the same for
   every row, does not move the output when its token changes.
4. ``mask_not_shifted``: with the keys and positions right, changing a token moves a row before
   it (the chunk sees its own future), or leaves rows that should read it unmoved in a pattern
   that depends on the row (the chunk sees too little of the past).
5. ``unexplained``: none of these fits; the evidence gathered is kept.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from attn_ledger.errors import SetupError, first_line
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.probes.common.forward import abs_delta, output_scale
from attn_ledger.report import Check, Report, Row, bounded, first_finding_of, row_status, unjudged
from attn_ledger.seeding import generator
from attn_ledger.tolerance import relative as relative_tolerance

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_LENGTH = 32
CHUNK_SIZES = (3, 4)
BLOCK = 16  # a typical cache block; one prefill runs past it
PREFILL_LENGTHS = (5, BLOCK + 1)
MIN_LENGTH = 4
_TABLE_MARGIN = 8  # positions past the chunk's end that the position table covers

DIAGNOSES: dict[str, str] = {
    "positions_offset": "positions offset: the decoded tokens sit at other positions than in the full forward",
    "cache_one_short": "cache one short: attention reads one key fewer than the positions so far",
    "cache_one_long": "cache one long: attention reads one key more than the positions so far",
    "mask_not_shifted": "mask not shifted for the cached prefix",
    "state_shared": "state shared between caches: the decode keeps state outside the cache it is given",
    "unexplained": "fits none of: positions offset, cache one short or long, mask not shifted, state shared",
}


# --- the plan ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """One way of decoding: chunk sizes (summing to T) and how many sequences are interleaved."""

    name: str
    chunks: tuple[int, ...]
    sequences: int = 1

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((0,) + self.chunks[:-1]))

    @property
    def calls(self) -> int:
        return len(self.chunks) * self.sequences


def plan_scenarios(length: int = DEFAULT_LENGTH) -> tuple[Scenario, ...]:
    """The scenarios for sequences of ``length`` positions (prefills that leave no single token are left out)."""
    chunks, left = [], length
    for size in itertools.cycle(CHUNK_SIZES):
        if left <= 0:
            break
        chunks.append(min(size, left))
        left -= chunks[-1]
    plan = [Scenario("tokens", (1,) * length), Scenario("chunks", tuple(chunks))]
    plan += [Scenario(f"prefill_{p}", (p,) + (1,) * (length - p)) for p in PREFILL_LENGTHS if p < length]
    plan.append(Scenario("two_sequences", (1,) * length, sequences=2))
    return tuple(plan)


def chunk_of(scenario: Scenario, position: int) -> int:
    """The index of the chunk that decodes ``position``."""
    return max(c for c, s in enumerate(scenario.starts) if s <= position)


# --- calling the user's decode -----------------------------------------------------------------

def validate_decode(fn: Any, field_name: str = "--decode") -> None:
    """A decode function must take ``(module, x_new, cache)`` positionally.

    Raises:
        SetupError: not callable, or a signature that cannot bind three positional arguments.
    """
    if not callable(fn):
        raise SetupError(f"{field_name}: got a {type(fn).__name__}, expected a callable NAME(module, x_new, cache)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: let the calls say
    try:
        sig.bind(None, None, None)
    except TypeError:
        raise SetupError(f"{field_name}: got {getattr(fn, '__name__', 'decode')}{sig}, "
                         "expected NAME(module, x_new, cache) -> (y_new, cache)") from None


class DecodeCallError(Exception):
    """A decode call raised, or returned something other than ``(y_new [B, t, E], cache)``."""

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.data: dict[str, Any] = data


@dataclass(frozen=True)
class _Decoder:
    """The user's module and decode function, called the one way the protocol allows."""

    module: "nn.Module"
    fn: Callable[..., Any]

    def __call__(self, x_new: "torch.Tensor", cache: Any) -> tuple["torch.Tensor", Any]:
        return self.observed(x_new, cache, observe=False)[:2]

    def observed(self, x_new: "torch.Tensor", cache: Any, observe: bool = True) -> tuple["torch.Tensor", Any, Any]:
        """The call, and with ``observe`` the attention core it ran (:class:`_CoreObserver`): ``(y, cache, core)``."""
        import torch

        from attn_ledger.guard import forwarded as is_remote

        shape = tuple(x_new.shape)
        core = None
        try:
            with user_call(f"decode(module, x_new {shape}, cache)"):
                if is_remote(self.module):  # the parent's stand-in: decoded, and observed, in the worker
                    result, core = self.module.decode_step(x_new, cache, f"decode(module, x_new {shape}, cache)", observe)
                elif observe:
                    with _CoreObserver() as seen:
                        result = self.fn(self.module, x_new, cache)
                    core = seen.core
                else:
                    result = self.fn(self.module, x_new, cache)
        except UserCodeError:
            raise  # an exit or the time limit: the check stops at this call (an L1 call finding)
        except Exception as exc:  # the user's decode may raise anything
            raise DecodeCallError(f"decode raised {type(exc).__name__} on x_new {shape}: {first_line(exc)}",
                                  input=list(shape), exception=type(exc).__name__) from None
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise DecodeCallError(f"decode returned {type(result).__name__}, expected a pair (y_new [B, t, E], cache)",
                                  input=list(shape), returned=type(result).__name__)
        y, new_cache = result
        if not isinstance(y, torch.Tensor):
            raise DecodeCallError(f"decode returned y_new of type {type(y).__name__}, expected a tensor [B, t, E]",
                                  input=list(shape), returned=type(y).__name__)
        if y.layout != torch.strided or y.is_meta:
            raise DecodeCallError(f"decode returned a {'meta' if y.is_meta else 'sparse'} tensor, "
                                  "expected a dense tensor [B, t, E] with values", input=list(shape),
                                  returned="meta tensor" if y.is_meta else "sparse tensor")
        if tuple(y.shape) != shape:
            raise DecodeCallError(f"decode returned y_new of shape {tuple(y.shape)} for x_new {shape} [B, t, E], "
                                  "expected the same shape", input=list(shape), output=list(y.shape))
        return y.detach(), new_cache, core


def _decode(dec: _Decoder, x: "torch.Tensor", chunks: Sequence[int], upto: int | None = None,
            observe_last: bool = False) -> tuple[list["torch.Tensor"], "_Core | None"]:
    """Decode ``x [B, T, E]`` chunk by chunk from an empty cache, through chunk ``upto`` (default all).

    Returns the outputs ``[B, t, E]`` per chunk, and the attention core observed in the last call
    when ``observe_last``. A failing call raises :class:`DecodeCallError` with its chunk.
    """
    import torch

    last = len(chunks) - 1 if upto is None else upto
    outputs, cache, core = [], None, None
    start = 0
    with torch.no_grad():
        for c, size in enumerate(chunks[: last + 1]):
            x_new = x[:, start : start + size].contiguous()  # [B, t, E]
            try:
                if observe_last and c == last:
                    y, cache, core = dec.observed(x_new, cache)
                else:
                    y, cache = dec(x_new, cache)
            except DecodeCallError as exc:
                exc.data.update(chunk=c, position=start, chunk_size=size)
                raise
            outputs.append(y)
            start += size
    return outputs, core


def _decode_pair(dec: _Decoder, xs: Sequence["torch.Tensor"], chunks: Sequence[int]) -> list[list["torch.Tensor"]]:
    """Decode several sequences with a cache each, their calls interleaved chunk by chunk."""
    import torch

    outputs: list[list[torch.Tensor]] = [[] for _ in xs]
    caches: list[Any] = [None for _ in xs]
    start = 0
    with torch.no_grad():
        for c, size in enumerate(chunks):
            for n, x in enumerate(xs):
                try:
                    y, caches[n] = dec(x[:, start : start + size].contiguous(), caches[n])
                except DecodeCallError as exc:
                    exc.data.update(chunk=c, position=start, chunk_size=size, sequence=n)
                    raise
                outputs[n].append(y)
            start += size
    return outputs


# --- observing the attention core ----------------------------------------------------------

@dataclass(frozen=True)
class _Core:
    """The q and k that entered attention in one call: ``[B, H, Tq, Dh]`` and ``[B, Hk, Tk, Dh]``."""

    via: str
    q: "torch.Tensor"
    k: "torch.Tensor"


def _matmuls() -> frozenset:
    import torch

    return frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm})


class _CoreObserver:
    """Context manager: records the first attention core call (SDPA, else the first batched q @ k^T)."""

    def __init__(self) -> None:
        self.core: _Core | None = None
        self._mode: Any = None

    def __enter__(self) -> "_CoreObserver":
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode

        observer, matmuls = self, _matmuls()

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if observer.core is None:
                    if func is F.scaled_dot_product_attention:
                        q = args[0] if len(args) > 0 else kwargs.get("query")
                        k = args[1] if len(args) > 1 else kwargs.get("key")
                        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
                            observer.core = _Core("sdpa", q.detach().clone(), k.detach().clone())
                    elif func in matmuls and len(args) >= 2 and _scores_operands(args[0], args[1]):
                        observer.core = _Core("matmul", args[0].detach().clone(),
                                              args[1].detach().transpose(-2, -1).clone())
                return func(*args, **kwargs)

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def _scores_operands(a: Any, b: Any) -> bool:
    """Whether ``a @ b`` looks like q @ k^T: both batched (3-D or more), a shared inner width of at least 2."""
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 3 and b.dim() >= 3
            and a.shape[-1] == b.shape[-2] and a.shape[-1] >= 2 and a.is_floating_point())


def _observe_forward(forward: Callable, x: "torch.Tensor", module: Any = None) -> tuple["torch.Tensor", _Core | None]:
    import torch

    from attn_ledger.guard import forwarded as is_remote

    watch = module.watching_core() if is_remote(module) else _CoreObserver()  # remote: observed in the worker
    with torch.no_grad(), watch as seen:
        y = forward(x)
    return y, seen.core


# --- comparing with the full forward ------------------------------------------------------------

@dataclass(frozen=True)
class Mismatch:
    """The first decoded position that disagrees with the full forward, and where it was decoded."""

    position: int
    chunk: int
    start: int
    size: int
    delta: float
    sequence: int = 0

    @property
    def row(self) -> int:
        """The row of the chunk's output that holds ``position``."""
        return self.position - self.start


@dataclass(frozen=True)
class Diagnosis:
    """Which usual cause a disagreement fits (:data:`DIAGNOSES`), the experiment that showed it, and its numbers.

    ``detail`` narrows the kind in words (``restarting at 0``, ``sees its own future``).
    """

    kind: str
    via: str
    evidence: dict[str, Any] = field(default_factory=dict)
    detail: str = ""

    @property
    def words(self) -> str:
        base = DIAGNOSES[self.kind]
        return f"{base} ({self.detail})" if self.detail else base


@dataclass(frozen=True)
class _Sequence:
    """One input sequence with its full forward and the tolerance it is judged at."""

    x: "torch.Tensor"  # [B, T, E]
    y: "torch.Tensor"  # [B, T, E], the full causal forward
    scale: float
    tolerance: float


@dataclass(frozen=True)
class _Subject:
    dec: _Decoder
    forward: Callable[["torch.Tensor"], "torch.Tensor"]
    rel: float
    seed: int


def _deltas(outputs: Sequence["torch.Tensor"], y_full: "torch.Tensor") -> "torch.Tensor":
    """``[T']`` max |decode - full| per decoded position (over B and E)."""
    import torch

    y = torch.cat(list(outputs), dim=1)  # [B, T', E]
    return abs_delta(y, y_full[:, : y.shape[1]]).amax(dim=(0, 2))  # [T']


def _first_mismatch(scenario: Scenario, deltas: "torch.Tensor", tolerance: float, sequence: int = 0) -> Mismatch | None:
    bad = (deltas > tolerance).nonzero()
    if len(bad) == 0:
        return None
    p = int(bad[0])
    c = chunk_of(scenario, p)
    return Mismatch(p, c, scenario.starts[c], scenario.chunks[c], float(deltas[p]), sequence)


# --- diagnosis ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Case:
    """A failing chunk of a single-sequence decode, with everything the probes read."""

    sub: _Subject
    seq: _Sequence
    chunks: tuple[int, ...]
    mis: Mismatch
    outputs: list["torch.Tensor"]  # per chunk, through the failing one
    core: _Core | None

    @property
    def end(self) -> int:
        return self.mis.start + self.mis.size


Probe = Callable[[_Case], "tuple[Diagnosis | None, dict[str, Any]]"]


def diagnose(sub: _Subject, scenario: Scenario, seqs: Sequence[_Sequence], outputs: Sequence[list["torch.Tensor"]],
             mis: Mismatch) -> Diagnosis:
    """Name the pattern of a disagreement (see the module docstring for the experiments, in order)."""
    seq = seqs[mis.sequence]
    if scenario.sequences > 1:
        try:
            alone, _ = _decode(sub.dec, seq.x, scenario.chunks, upto=mis.chunk)
        except DecodeCallError as exc:
            return Diagnosis("unexplained", "decoded alone", {"error": str(exc)})
        deltas = _deltas(alone, seq.y)
        single = _first_mismatch(scenario, deltas, seq.tolerance)
        if single is None:
            return Diagnosis("state_shared", "decoded alone", {
                "alone_max_delta": float(deltas.max()), "beside_another_delta": mis.delta,
                "tolerance": seq.tolerance}, "a sequence agrees decoded alone and not beside another")
        # Decoded alone it fails too: diagnose that; its rerun is compared with the interleaved
        # outputs, so a difference between the two still reads as state shared.
        mis = replace(single, sequence=mis.sequence)
    return _diagnose_single(sub, scenario, seq, list(outputs[mis.sequence][: mis.chunk + 1]), mis)


def _diagnose_single(sub: _Subject, scenario: Scenario, seq: _Sequence, outputs: list["torch.Tensor"],
                     mis: Mismatch) -> Diagnosis:
    """Rerun (state), then the probes in order; the first that fits names the pattern."""
    try:
        rerun, core = _decode(sub.dec, seq.x, scenario.chunks, upto=mis.chunk, observe_last=True)
    except DecodeCallError as exc:
        return Diagnosis("unexplained", "rerun", {"error": str(exc)})
    drift = max(float(abs_delta(a, b).max()) for a, b in zip(rerun, outputs))
    if drift > seq.tolerance:
        return Diagnosis("state_shared", "rerun", {"rerun_delta": drift, "tolerance": seq.tolerance},
                         "the same calls on the same inputs, rerun from an empty cache, give other outputs: "
                         "state kept outside the cache, or randomness")
    case = _Case(sub, seq, scenario.chunks, mis, rerun, core)
    evidence: dict[str, Any] = {}
    probes: tuple[Probe, ...] = (_observed_core, _modified_sequences, _dependency, _other_position)
    for probe in probes:
        try:
            found, seen = probe(case)
        except DecodeCallError as exc:
            found, seen = None, {f"{probe.__name__.strip('_')}_error": str(exc)}
        evidence.update(seen)
        if found is not None:
            return replace(found, evidence={**evidence, **found.evidence})
    return Diagnosis("unexplained", "every probe", evidence)


def _other_position(case: _Case) -> tuple[Diagnosis | None, dict[str, Any]]:
    """Is the decoded row the full forward's output at another position?"""
    import torch

    mis, y_full = case.mis, case.seq.y
    row = case.outputs[mis.chunk][:, mis.row : mis.row + 1]  # [B, 1, E]
    d = abs_delta(row.expand_as(y_full), y_full).amax(dim=(0, 2))  # [T]
    d[mis.position] = math.inf
    m = int(torch.argmin(d))
    if float(d[m]) <= case.seq.tolerance:
        return Diagnosis("positions_offset", "full forward", {"output_position": m, "position": mis.position},
                         "the output is the full forward's at another position"), {}
    return None, {}


def _position_table(case: _Case) -> tuple["torch.Tensor", "torch.Tensor"] | None:
    """Each token's q and k at every position: ``[B, e, H, M, Dh]`` and ``[B, e, Hk, M, Dh]``.

    One forward on sequences that repeat one token M times (token i of example b in row
    ``b * e + i``): the q and k a token gets at position m depend on the token and m only.
    """
    from attn_ledger.probes.common.forward import ForwardError

    x, e = case.seq.x, case.end
    b, _, emb = x.shape
    m = e + _TABLE_MARGIN
    rep = x[:, :e].reshape(b * e, 1, emb).expand(b * e, m, emb).contiguous()  # [B*e, M, E]
    try:
        _, core = _observe_forward(case.sub.forward, rep, case.sub.dec.module)
    except ForwardError:
        return None
    if core is None or core.q.dim() != 4 or core.k.dim() != 4 or core.q.shape[0] != b * e \
            or core.q.shape[2] != m or core.k.shape[:1] + core.k.shape[2:3] != (b * e, m):
        return None
    return core.q.reshape(b, e, *core.q.shape[1:]), core.k.reshape(b, e, *core.k.shape[1:])


def _query_positions(q_tab: "torch.Tensor", q: "torch.Tensor", start: int, tol: float) -> list[int | None]:
    """The position whose table q each decoded query row equals (token start + i), or None."""
    import torch

    found: list[int | None] = []
    for i in range(q.shape[2]):
        cand = q_tab[:, start + i].to(torch.float64)  # [B, H, M, Dh]
        d = (cand - q[:, :, i, None].to(torch.float64)).abs().amax(dim=(0, 1, 3))  # [M]
        m = start + i if float(d[start + i]) <= tol else int(d.argmin())  # positions that look alike: the expected one
        found.append(m if float(d[m]) <= tol else None)
    return found


def _key_identities(k_tab: "torch.Tensor", k: "torch.Tensor", tol: float) -> list[list[int] | None]:
    """``[token, position]`` of the table entry each observed key row equals, or None."""
    import torch

    b, e, h, m, dh = k_tab.shape
    table = k_tab.permute(1, 3, 0, 2, 4).reshape(e * m, b * h * dh).to(torch.float64)  # [e*M, B*Hk*Dh]
    rows = k.permute(2, 0, 1, 3).reshape(k.shape[2], b * h * dh).to(torch.float64)  # [Tk, B*Hk*Dh]
    best = torch.cdist(rows, table).argmin(dim=1)  # [Tk]
    own = (best // m) * (m + 1)  # the same token at its own position, preferred where positions look alike
    best = torch.where((rows - table[own]).abs().amax(dim=1) <= tol, own, best)  # [Tk]
    gap = (rows - table[best]).abs().amax(dim=1)  # [Tk]
    return [[int(i) // m, int(i) % m] if float(g) <= tol else None for i, g in zip(best, gap)]


def _encoding(q_tab: "torch.Tensor") -> dict[str, Any]:
    """How q changes with position, by rotary recognition on the table (position 0 as the unrotated q)."""
    from attn_ledger.maths.rotary import recognise_rotary

    y = q_tab[:, :2]  # [B, 2, H, M, Dh]
    obs = recognise_rotary(y[..., :1, :].expand_as(y), y, positions=0)
    if obs.kind == "rotary" and obs.spec is not None:
        return {"kind": "rotary", "pairing": obs.spec.pairing, "base": obs.spec.base,
                "rotated_dim": obs.spec.width(obs.head_dim), "head_dim": obs.head_dim}
    return {"kind": "not rotary" if obs.kind == "none" else "unrecognised", "description": obs.describe()}


def _grouped_alike(k: "torch.Tensor", k_tab: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"] | None:
    """The decode call's k ``[B, Hk, Tk, Dh]`` and the table's k ``[B, e, Hk', M, Dh]`` with as many heads.

    A grouped-query module may hand SDPA its Nkv kv heads in one call (``enable_gqa``) and kv
    heads repeated to Nh in another (a library that repeats them itself whenever it passes a
    mask, as transformers' SDPA path does for a chunk over a cache). Both are read with kv head
    j serving query heads j*g .. j*g + g - 1, so the side with fewer heads is repeated that
    way; None where the head counts do not divide.
    """
    hk, ht = k.shape[1], k_tab.shape[2]
    if hk == ht:
        return k, k_tab
    if hk > ht and hk % ht == 0:
        return k, k_tab.repeat_interleave(hk // ht, dim=2)  # [B, e, Hk, M, Dh]
    if ht > hk and ht % hk == 0:
        return k.repeat_interleave(ht // hk, dim=1), k_tab  # [B, Hk', Tk, Dh]
    return None


def _observed_core(case: _Case) -> tuple[Diagnosis | None, dict[str, Any]]:
    """Compare the q and k entering attention in the failing call with each token's q and k by position."""
    core = case.core
    if core is None:
        return None, {"core": "not observed in the decode call"}
    table = _position_table(case)
    if table is None:
        return None, {"core": "not observed in the full forward"}
    q_tab, k_tab = table
    if core.q.dim() != 4 or core.k.dim() != 4 or core.q.shape[1] != q_tab.shape[2] \
            or core.q.shape[-1] != q_tab.shape[-1]:
        return None, {"core": f"observed ({core.via}) with other shapes than in the full forward"}
    aligned = _grouped_alike(core.k, k_tab)
    if aligned is None:
        return None, {"core": f"observed ({core.via}) with other kv heads than in the full forward"}
    core_k, k_tab = aligned
    rel = 2 * case.sub.rel
    qpos = _query_positions(q_tab, core.q, case.mis.start, rel * output_scale(q_tab))
    keys = _key_identities(k_tab, core_k, rel * output_scale(k_tab))
    evidence: dict[str, Any] = {"core": core.via, "query_positions": qpos,
                                "expected_query_positions": list(range(case.mis.start, case.end)),
                                "keys": keys, "expected_keys": case.end}
    if any(p is None for p in qpos) or any(k is None for k in keys):
        return None, evidence
    found, seen = _judge_core(case, q_tab, qpos, keys)
    return found, {**evidence, **seen}


def _judge_core(case: _Case, q_tab: "torch.Tensor", qpos: list[int],
                keys: list[list[int]]) -> tuple[Diagnosis | None, dict[str, Any]]:
    """Keys less one or with one twice; then positions; no diagnosis when q and k are as in the full forward."""
    e, start = case.end, case.mis.start
    tokens = sorted(tok for tok, _ in keys)
    missing = sorted(set(range(e)) - set(tokens))
    twice = sorted({tok for tok in tokens if tokens.count(tok) > 1})
    if len(tokens) == e - 1 and len(missing) == 1 and not twice:
        found = {"keys_read": len(tokens), "missing_position": missing[0]}
        return Diagnosis("cache_one_short", "observed keys", found), {}
    if len(tokens) == e + 1 and len(twice) == 1 and not missing:
        found = {"keys_read": len(tokens), "duplicated_position": twice[0]}
        return Diagnosis("cache_one_long", "observed keys", found), {}
    if missing or twice:
        return None, {"missing_positions": missing, "duplicated_positions": twice}
    wrong_q = [i for i, m in enumerate(qpos) if m != start + i]
    wrong_k = [tok for tok, pos in keys if pos != tok]
    if not wrong_q and not wrong_k:
        return None, {"core_inputs": "as in the full forward"}
    restarting = start > 0 and qpos == list(range(len(qpos)))
    found = {"query_offset": qpos[wrong_q[0]] - start - wrong_q[0] if wrong_q else 0,
             "keys_misplaced": len(wrong_k), "restarting": restarting, "position_encoding": _encoding(q_tab)}
    detail = "positions restart at 0 on every call" if restarting else "the new tokens' positions are shifted"
    return Diagnosis("positions_offset", "observed q and k", found, detail), {}


def _modified_sequences(case: _Case) -> tuple[Diagnosis | None, dict[str, Any]]:
    """Is the decoded row the full forward's on the sequence with one token removed, or one token twice?

    Exact where positions are relative (rotary, removing the oldest token) or absent; a
    miss proves nothing, so these only ever confirm.
    """
    import torch

    x, mis = case.seq.x, case.mis
    p, s = mis.position, mis.start
    row = case.outputs[mis.chunk][:, mis.row]  # [B, E]
    trials: list[tuple[str, int, torch.Tensor]] = []
    for j in sorted({0, s - 1, p - 1} - {-1}):
        if j < p:
            trials.append(("cache_one_short", j, torch.cat([x[:, :j], x[:, j + 1 : p + 1]], dim=1)))  # [B, p, E]
    for j in sorted({s - 1, p - 1, p} - {-1}):
        trials.append(("cache_one_long", j, torch.cat([x[:, : j + 1], x[:, j : p + 1]], dim=1)))  # [B, p+2, E]
    with torch.no_grad():
        for kind, j, xm in trials:
            d = float(abs_delta(case.sub.forward(xm)[:, -1], row).max())
            if d <= case.seq.tolerance:
                key = "missing_position" if kind == "cache_one_short" else "duplicated_position"
                how = "without" if kind == "cache_one_short" else "with twice"
                return Diagnosis(kind, f"full forward {how} one position", {key: j, "delta": d}), {}
    return None, {}


def _replaced(x: "torch.Tensor", position: int, seed: int) -> "torch.Tensor":
    """``x`` with the token at ``position`` replaced by a fresh one of the same size (seeded)."""
    import torch

    g = generator(seed * 1009 + position + 7)
    x64 = x.detach().to(torch.float64)
    rms = float(x64.square().mean().sqrt()) or 1.0
    out = x.detach().clone()
    out[:, position] = (torch.randn(x.shape[0], x.shape[2], generator=g, dtype=torch.float64) * rms).to(x.dtype)
    return out


def _dependency(case: _Case) -> tuple[Diagnosis | None, dict[str, Any]]:
    """Which tokens move which rows of the failing chunk: change one token, decode again, compare.

    Row i (position s + i) must move for every probed token at or before s + i and for
    none after it. Probed: the first token, one in the middle of the cached prefix, the
    last cached one, and each token of the chunk.
    """
    s, t = case.mis.start, case.mis.size
    probes = sorted(({0, s // 2, s - 1} - {-1}) | set(range(s, s + t)))
    future, unread = [], []
    for j in probes:
        outs, _ = _decode(case.sub.dec, _replaced(case.seq.x, j, case.sub.seed), case.chunks, upto=case.mis.chunk)
        moved = abs_delta(outs[-1], case.outputs[-1]).amax(dim=(0, 2))  # [t]
        for i in range(t):
            if j > s + i and float(moved[i]) > case.seq.tolerance:
                future.append([s + i, j])
            elif j < s + i and not float(moved[i]) > case.seq.tolerance:
                unread.append([s + i, j])
    evidence = {"probed_positions": probes, "read_after_row": future, "not_read": unread}
    return _judge_dependency(s, t, future, unread), evidence


def _judge_dependency(s: int, t: int, future: list[list[int]], unread: list[list[int]]) -> Diagnosis | None:
    """Which pattern the changed tokens show (rows and keys as ``[row position, key position]``).

    A row moved by a later token: the mask is not shifted (the chunk sees its own future).
    Past keys not read: the same single key for every row is a cache one short; keys inside
    the chunk, or a pattern that depends on the row, or (one token per call) several keys is
    a mask that lets the new tokens see too little of the past. Several keys missed alike by
    every row of a chunk fit neither, and are left to the other probes.
    """
    if future:
        return Diagnosis("mask_not_shifted", "changed tokens", {}, "a decoded chunk sees its own future")
    if not unread:
        return None
    by_row: dict[int, set[int]] = {}
    for p, j in unread:
        by_row.setdefault(p, set()).add(j)
    keys = {j for _, j in unread}
    inside = any(j >= s for j in keys)
    alike = all(by_row.get(p, set()) == {j for j in keys if j < p} for p in range(s, s + t))
    if alike and not inside and len(keys) == 1:
        return Diagnosis("cache_one_short", "changed tokens", {"missing_position": keys.pop()},
                         "one cached position is never read")
    if inside or not alike or t == 1:
        return Diagnosis("mask_not_shifted", "changed tokens", {}, "the decoded tokens see too little of the past")
    return None


# --- scenarios, checks and rows ----------------------------------------------------------------

@dataclass(frozen=True)
class ScenarioResult:
    """One scenario decoded and compared.

    Attributes:
        scenario: what was decoded.
        max_delta: max |decode - full forward| over every decoded position (None after a failed call).
        tolerance: the bound per position (of the sequence the first mismatch is in, else of the first).
        scale, rel_tolerance: the tolerance's parts: max |full forward| and the dtype's fraction of it.
        mismatch: the first disagreeing position, or None.
        bad_positions: how many decoded positions disagree (over the sequences).
        diagnosis: the pattern of the mismatch.
        error: the decode call that raised or returned the wrong thing (a level-1 finding).
    """

    scenario: Scenario
    max_delta: float | None
    tolerance: float
    scale: float
    rel_tolerance: float
    mismatch: Mismatch | None = None
    bad_positions: int = 0
    diagnosis: Diagnosis | None = None
    error: DecodeCallError | None = field(default=None, compare=False)


def run_scenario(sub: _Subject, scenario: Scenario, seqs: Sequence[_Sequence]) -> ScenarioResult:
    """Decode, compare every position with the full forward, and diagnose the first mismatch."""
    used = list(seqs[: scenario.sequences])
    first = used[0]
    try:
        if scenario.sequences == 1:
            outputs = [_decode(sub.dec, first.x, scenario.chunks)[0]]
        else:
            outputs = _decode_pair(sub.dec, [s.x for s in used], scenario.chunks)
    except DecodeCallError as exc:
        return ScenarioResult(scenario, None, first.tolerance, first.scale, sub.rel, error=exc)
    deltas = [_deltas(out, s.y) for out, s in zip(outputs, used)]
    found = [m for n, (d, s) in enumerate(zip(deltas, used)) if (m := _first_mismatch(scenario, d, s.tolerance, n))]
    bad = sum(int((d > s.tolerance).sum()) for d, s in zip(deltas, used))
    max_delta = max(float(d.max()) for d in deltas)
    if not found:
        return ScenarioResult(scenario, max_delta, first.tolerance, first.scale, sub.rel)
    mis = min(found, key=lambda m: (m.position, m.sequence))
    seq = used[mis.sequence]
    return ScenarioResult(scenario, max_delta, seq.tolerance, seq.scale, sub.rel, mis, bad,
                          diagnose(sub, scenario, used, outputs, mis))


PARITY_FAIL = "max |decode - full forward| at the first position that disagrees"
PARITY_PASS = "max |decode - full forward| over every decoded position"


def scenario_checks(res: ScenarioResult) -> tuple[Check, Check]:
    """L1 ``decode_call`` and L4 ``decode_parity`` for one scenario."""
    sc = res.scenario
    if res.error is not None:
        where = {k: res.error.data[k] for k in ("sequence", "chunk", "position", "chunk_size") if k in res.error.data}
        return (Check(1, "decode_call", "fail", location=where, reason=str(res.error), data=dict(res.error.data)),
                unjudged(4, "decode_parity", "not_reached", "a decode call failed (level 1)"))
    call = Check(1, "decode_call", "pass", "decode calls returning (y_new [B, t, E], cache)", sc.calls)
    data: dict[str, Any] = {"max_delta": res.max_delta, "bad_positions": res.bad_positions, "scale": res.scale,
                            "rel_tolerance": res.rel_tolerance}
    mis = res.mismatch
    if mis is None:
        return call, bounded(4, "decode_parity", PARITY_PASS, res.max_delta or 0.0, res.tolerance, data=data)
    where: dict[str, Any] = {"position": mis.position, "chunk": mis.chunk, "chunk_start": mis.start,
                             "chunk_size": mis.size}
    if sc.sequences > 1:
        where = {"sequence": mis.sequence, **where}
    diag = res.diagnosis or Diagnosis("unexplained", "none")
    data.update(diagnosis=diag.kind, diagnosis_detail=diag.detail, diagnosed_by=diag.via, evidence=diag.evidence)
    return call, bounded(4, "decode_parity", PARITY_FAIL, mis.delta, res.tolerance, location=where,
                         reason=diag.words, data=data)


def scenario_row(res: ScenarioResult) -> Row:
    checks = scenario_checks(res)
    status = "not_reached" if all(c.status == "not_reached" for c in checks) else row_status(checks)
    fields = {"calls": res.scenario.calls,
              "first_bad": res.mismatch.position if res.mismatch else None,
              "diagnosis": res.diagnosis.kind if res.diagnosis else None}
    return Row(f"decode_{res.scenario.name}", status, checks, fields=fields)


def _unreached_rows(plan: Sequence[Scenario], why: str) -> list[Row]:
    return [Row(f"decode_{sc.name}", "not_reached", (unjudged(1, "decode_call", "not_reached", why),
                                                     unjudged(4, "decode_parity", "not_reached", why)))
            for sc in plan]


def decode_rows(module: "nn.Module", decode: Callable[..., Any], embed_dim: int, *, seed: int = 0,
                length: int = DEFAULT_LENGTH, batch_size: int = 2,
                progress: Callable[[int, int], None] | None = None) -> tuple[list[Row], dict[str, Any]]:
    """Decode parity of ``decode`` on ``module`` (put in eval mode): one row per scenario, and details.

    Args:
        module: the user's module, already built.
        decode: ``decode(module, x_new, cache) -> (y_new, cache)``.
        embed_dim: E.
        seed: seeds the input sequences and the tokens the probes change.
        length: T, the positions each scenario decodes (at least 4).
        batch_size: B of every call.
        progress: ``callback(done, total)`` after each scenario.

    Returns:
        ``(rows, details)``: rows ``decode_<scenario>`` with checks ``decode_call`` (L1) and
        ``decode_parity`` (L4); details for the report's ``details["decode"]``.
    """
    import torch

    from attn_ledger.errors import field_error
    from attn_ledger.probes.common.forward import ForwardError, call_forward, module_dtype

    if isinstance(length, bool) or not isinstance(length, int) or length < MIN_LENGTH:
        raise field_error("decode length", length, f"an integer >= {MIN_LENGTH}")
    plan = plan_scenarios(length)
    details = {"positions": length, "batch": batch_size, "scenarios": {sc.name: list(sc.chunks) for sc in plan}}
    module.eval()
    dtype = module_dtype(module)
    sub = _Subject(_Decoder(module, decode), lambda x: call_forward(module, x), relative_tolerance(dtype), seed)
    g = generator(seed)
    seqs = []
    for _ in range(2):
        x = torch.randn(batch_size, length, embed_dim, generator=g, dtype=torch.float64).to(dtype)  # [B, T, E]
        try:
            with torch.no_grad():
                y = call_forward(module, x).detach()  # [B, T, E]
        except ForwardError as exc:
            return _unreached_rows(plan, f"the full forward failed: {exc}"), details
        scale = output_scale(y)
        seqs.append(_Sequence(x, y, scale, sub.rel * scale))
    rows = []
    for n, sc in enumerate(plan, start=1):
        rows.append(scenario_row(run_scenario(sub, sc, seqs)))
        if progress:
            progress(n, len(plan))
    return rows, details


def with_decode(report: Report, rows: Sequence[Row], details: dict[str, Any]) -> Report:
    """``report`` with the decode rows after its own: its own first finding (its headline), else the decode rows' first."""
    all_rows = tuple(report.rows) + tuple(rows)
    return replace(report, rows=all_rows, first_finding=report.first_finding or first_finding_of(all_rows),
                   details={**report.details, "decode": details}, title=f"{report.title} decode")


__all__ = ["DIAGNOSES", "Diagnosis", "Mismatch", "Scenario", "ScenarioResult", "DecodeCallError", "decode_rows",
           "diagnose", "plan_scenarios", "run_scenario", "scenario_checks", "validate_decode", "with_decode"]
