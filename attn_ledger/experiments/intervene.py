"""``attn-ledger intervene``: change only the future, rerun, and see whether the past moved.

The probe itself lives in :mod:`attn_ledger.probes.common.forward`; this module runs it on the
subject under both grad paths and on the controls, and assembles the report:

* a ``determinism`` row: two eval-mode calls agree bitwise. It comes first, because every
  delta of the cut rows assumes an eval-mode output is a function of the input;
* one row per grad path and cut (``no_grad i=0``, ...) with the prefix and suffix deltas
  as fields, and three checks: the output stays finite, the prefix
  holds still (``prefix_unchanged``; a leak fails it), the suffix moves (``suffix_moved``;
  an intervention that changed nothing fails it);
* one row per control, a module built to leak: ``control_leaks`` fails when the control is
  not reported as a leak, because then the probe has no power here;
* a forward that raises or returns the wrong shape is a level-1 row of its own;
* a forward that exits, runs past its time limit or (in a worker) crashes stops the run: the
  report then holds one ``call`` row with that L1 finding (:func:`stopped_intervention`).

The first finding is the first failing row in that order. Nothing here decides exit
codes; the report's verdict does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from attn_ledger.probes.common.forward import (
    GRAD_MODES,
    Determinism,
    InterventionResult,
    build_module,
    builtin_controls,
    causal_intervention,
    control_check,
    cut_checks,
    default_cuts,
    determinism_check,
    eval_determinism,
    forward_failure,
    module_dtype,
    module_forward,
)
from attn_ledger.guard import UserCodeError
from attn_ledger.report import Check, Coverage, Note, Report, Row, row_status
from attn_ledger.seeding import manual_seed

if TYPE_CHECKING:
    import torch
    from torch import nn

_CAUSAL_MASKS = ("causal", "causal-top-left")

BUILTIN_CONTROLS_NOTE = Note("controls", {"of": "builtin"})  # two leaking versions of the same pipeline
MODULE_CONTROLS_NOTE = Note("controls", {"of": "module"})  # the built-in pipeline beside a user's module


def _path_rows(result: InterventionResult) -> list[Row]:
    """One row per cut of one grad path, or one level-1 row when its forward failed."""
    mode = result.grad_mode
    if result.error is not None:
        check = forward_failure(1, "forward", result.error)
        return [Row(mode, "fail", (check,))]
    rows = []
    for cut in result.cuts:
        checks = cut_checks(cut)
        fields = {"prefix": cut.prefix_delta, "suffix": cut.suffix_delta}
        rows.append(Row(f"{mode} i={cut.cut}", row_status(checks), checks, fields=fields))
    return rows


def _control_row(name: str, description: str, result: InterventionResult) -> Row:
    check = control_check(name, description, result)
    fields = {} if result.error is not None else {"prefix": result.max_prefix_delta, "suffix": result.min_suffix_delta}
    return Row(f"control {name}", check.status, (check,), fields=fields)


@dataclass(frozen=True)
class _Runs:
    """Every forward of one ``intervene``: both grad paths, the determinism probe, the controls."""

    paths: tuple[InterventionResult, ...]
    determinism: Determinism | None
    controls: tuple[tuple[str, str, InterventionResult], ...]


def _run_all(module: "nn.Module", x: "torch.Tensor", cuts: tuple[int, ...],
             controls: Sequence[tuple[str, str, "nn.Module"]], seed: int,
             progress: Callable[[int, int], None] | None) -> _Runs:
    per_run = len(cuts) + 1
    total = per_run * (2 + len(controls)) + 2
    done = 0

    def step(offset: int) -> Callable[[int, int], None] | None:
        if progress is None:
            return None
        return lambda d, _t: progress(offset + d, total)

    paths = []
    for mode in GRAD_MODES:
        paths.append(causal_intervention(module_forward(module), x, cuts=cuts, grad_mode=mode, seed=seed,
                                         progress=step(done)))
        done += per_run
    determinism = eval_determinism(module_forward(module), x) if all(p.error is None for p in paths) else None
    done += 2
    if progress:
        progress(done, total)
    results = []
    for name, description, control in controls:
        control.eval()
        results.append((name, description, causal_intervention(module_forward(control), x, cuts=cuts,
                                                                grad_mode="no_grad", seed=seed, progress=step(done))))
        done += per_run
    if progress:
        progress(total, total)
    return _Runs(tuple(paths), determinism, tuple(results))


def _notes(runs: _Runs, controls_note: Note | None, training: bool) -> list[Note]:
    ok = next((p for p in runs.paths if p.error is None), None)
    notes = []
    if ok is not None:
        notes.append(Note("intervention_bounds", {"rel_tolerance": ok.rel_tolerance, "dtype": ok.dtype,
                                                  "suffix_fraction": ok.suffix_fraction, "scale": ok.scale}))
    if runs.controls:
        notes.append(Note("control_rows"))
    if runs.determinism is not None and not runs.determinism.identical:
        notes.append(Note("eval_differs"))
    if controls_note is not None:
        notes.append(controls_note)
    if training:
        notes.append(Note("training_on_entry", {"ran": "intervene"}))
    return notes


def _details(runs: _Runs, subject: str, shape: tuple[int, ...], num_heads: int, cuts: tuple[int, ...],
             training: bool) -> dict[str, Any]:
    b, t, e = shape
    ok = next((p for p in runs.paths if p.error is None), None)
    bounds = {"dtype": None, "scale": None, "rel_tolerance": None, "suffix_fraction": None, "tolerance": None,
              "threshold": None}
    if ok is not None:
        bounds = {"dtype": ok.dtype, "scale": ok.scale, "rel_tolerance": ok.rel_tolerance,
                  "suffix_fraction": ok.suffix_fraction, "tolerance": ok.tolerance, "threshold": ok.threshold}
    return {"subject": subject, "sizes": {"B": b, "T": t, "E": e, "Nh": num_heads}, "cuts": list(cuts), **bounds,
            "paths": {p.grad_mode: p.verdict for p in runs.paths}, "controls": [name for name, _d, _r in runs.controls],
            "training_mode_on_entry": training}


def intervene_report(
    module: "nn.Module",
    x: "torch.Tensor",
    *,
    subject: str,
    num_heads: int,
    cuts: Sequence[int] | None = None,
    controls: Sequence[tuple[str, str, "nn.Module"]] = (),
    controls_note: Note | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Run the intervention on ``module`` in eval mode under both grad modes, then the controls.

    Args:
        module: the module under test; it is put into eval mode here.
        x: the input ``[B, T, E]``.
        subject: a name for the output.
        num_heads: Nh, for the output only.
        cuts: cut positions; None means 0..T-2.
        controls: ``(name, description, module)`` triples that must leak. With none, the
            report's coverage says nothing shows the probe can fail.
        controls_note: the note saying what the controls show (:data:`BUILTIN_CONTROLS_NOTE`,
            :data:`MODULE_CONTROLS_NOTE`), or None.
        seed: seeds the replacement values.
        progress: ``callback(done, total)``.

    Returns:
        A :class:`~attn_ledger.report.Report` (command ``intervene``, one test case per row).
    """
    training = bool(module.training)
    module.eval()
    b, t, e = x.shape
    cut_list = tuple(default_cuts(t) if cuts is None else cuts)
    try:
        runs = _run_all(module, x, cut_list, controls, seed, progress)
    except UserCodeError as exc:
        return stopped_intervention(subject, (b, t, e), num_heads, f"{exc.what} {exc}", exc.facts(), cut_list, training)
    rows: list[Row] = []
    if runs.determinism is not None:
        check = determinism_check(runs.determinism)
        rows.append(Row("determinism", check.status, (check,)))
    for p in runs.paths:
        rows += _path_rows(p)
    rows += [_control_row(name, description, r) for name, description, r in runs.controls]
    coverage = None if controls else Coverage(
        "no controls", ("control_leaks",), "no control ran, so nothing here shows the probe can fail")
    return Report("intervene", f"CAUSAL INTERVENTION {subject} B={b} T={t} E={e} Nh={num_heads}", tuple(rows),
                  coverage=coverage, notes=tuple(_notes(runs, controls_note, training)),
                  details=_details(runs, subject, (b, t, e), num_heads, cut_list, training),
                  unit="row", row_label="run", show_passing=False)


def stopped_intervention(subject: str, shape: tuple[int, ...], num_heads: int, reason: str, data: dict[str, Any],
                         cuts: Sequence[int] = (), training: bool = False) -> Report:
    """The report when a call into the module did not come back (an exit, the time limit, a crash).

    One ``call`` row holds the L1 ``call`` finding (``reason`` and ``data`` say which call and how
    it ended); no path, cut or control was judged, since no later call could be trusted to return.
    """
    b, t, e = shape
    called = Check(1, "call", "fail", reason=reason, data=data)
    runs = _Runs((), None, ())
    notes = [Note("intervention_stopped")]
    coverage = Coverage("stopped", ("prefix_unchanged", "suffix_moved", "eval_determinism", "control_leaks"),
                        "a call into the module did not come back, so nothing else ran")
    return Report("intervene", f"CAUSAL INTERVENTION {subject} B={b} T={t} E={e} Nh={num_heads}",
                  (Row("call", "fail", (called,)),), coverage=coverage, notes=tuple(notes),
                  details=_details(runs, subject, (b, t, e), num_heads, tuple(cuts), training),
                  unit="row", row_label="run", show_passing=False)


def plan_intervene(config: Path | None = None, *, module_spec: str | None = None,
                   overrides: dict[str, Any] | None = None, at: int | None = None, max_memory: int | None = None,
                   option_names: Mapping[str, str] | None = None) -> tuple[Any, list[int] | None]:
    """Validate an ``intervene`` request: the config with its overrides, and the cuts (None: all).

    ``option_names`` (config key -> option) names the option in a message about a key that came
    from one; ``max_memory`` is the memory budget in bytes (default: what the machine has free).

    Raises:
        InputError: a config or option out of range.
        ResourceError: the sizes would not fit in memory.
    """
    from attn_ledger.inputs.config import load_config
    from attn_ledger.errors import InputError
    from attn_ledger.inputs.limits import require_fits
    from attn_ledger.engine.budget import estimate_module

    overrides = dict(overrides or {})
    if module_spec is not None and (overrides.get("embed_dim") is None or overrides.get("num_heads") is None):
        raise InputError("--module needs --embed-dim and --heads: the factory is called as FACTORY(embed_dim, num_heads)")
    cfg = load_config(config, overrides, option_names)
    if cfg.tq != cfg.tk:
        raise InputError(f"intervene needs self-attention: got query_len={cfg.tq}, key_len={cfg.tk}, expected seq_len")
    t = cfg.tq
    if t < 2:
        raise InputError(f"seq_len: got {t}, expected at least 2 (a cut needs a position on each side)")
    if cfg.batch_size < 1:
        raise InputError(f"batch_size: got {cfg.batch_size}, expected at least 1")
    if at is not None and not 0 <= at <= t - 2:
        raise InputError(f"--at: got {at}, expected a cut between 0 and seq_len-2={t - 2}")
    require_fits(estimate_module(cfg.embed_dim, cfg.num_heads, cfg.batch_size, t,
                                 f"intervene B={cfg.batch_size} T={t} E={cfg.embed_dim}"), max_memory)
    return cfg, None if at is None else [at]


def module_task_args(cfg: Any, module_spec: str, cuts: list[int] | None, with_controls: bool) -> dict[str, Any]:
    """What :func:`intervene_module` and the factory need, as plain data (for a worker process)."""
    return {"spec": module_spec, "field": "--module", "embed_dim": cfg.embed_dim, "num_heads": cfg.num_heads,
            "batch_size": cfg.batch_size, "seq_len": cfg.tq, "input_kind": cfg.input, "seed": cfg.seed,
            "dtype": cfg.dtype, "cuts": cuts, "with_controls": with_controls}


def intervene_module(module: "nn.Module", args: dict[str, Any], progress: Callable[[int, int], None] | None = None) -> Report:
    """``intervene --module`` once the factory has built ``module``; ``args`` from :func:`module_task_args`.

    The input ``[B, T, E]`` is the built-in pipeline's, in the module's own floating dtype;
    the controls are the built-in pipeline at the same sizes. torch's generator is seeded
    around the runs, so a module that draws random numbers in its forward (dropout left on)
    gives the same report twice.
    """
    import torch

    from attn_ledger.maths.pipeline import make_input

    dtype = getattr(torch, args["dtype"])
    x = make_input(args["batch_size"], args["seq_len"], args["embed_dim"], args["input_kind"], args["seed"], dtype)
    x = x.to(module_dtype(module, dtype))  # [B, T, E]
    with_controls = args["with_controls"]
    control_list = builtin_controls(args["embed_dim"], args["num_heads"], args["seed"], x.dtype) if with_controls else []
    from attn_ledger.guard import forwarded as is_remote

    if is_remote(module):  # the forwards draw from the worker's generator: seeded there as it is here
        module.manual_seed(args["seed"])
    with torch.random.fork_rng(devices=[]):
        manual_seed(args["seed"])
        return intervene_report(module, x, subject=f"module {args['spec']}", num_heads=args["num_heads"],
                                cuts=args["cuts"], controls=control_list,
                                controls_note=MODULE_CONTROLS_NOTE if with_controls else None, seed=args["seed"],
                                progress=progress)


def run_intervene(
    config: Path | None = None,
    *,
    module_spec: str | None = None,
    overrides: dict[str, Any] | None = None,
    at: int | None = None,
    with_controls: bool = True,
    progress: Callable[[int, int], None] | None = None,
    max_memory: int | None = None,
    option_names: Mapping[str, str] | None = None,
) -> Report:
    """``attn-ledger intervene`` in this process: the built-in pipeline from a config, or a user's module.

    (The command runs a ``--module`` in a worker process instead, through
    :func:`attn_ledger.runner.worker.run_user_task`.)

    Args:
        config: TOML or JSON config for the built-in pipeline (None: the embedded default);
            with ``module_spec`` it supplies the sizes, the input and the seed.
        module_spec: ``path/to/file.py:FACTORY`` or ``pkg.mod:FACTORY``, called as
            ``FACTORY(embed_dim, num_heads)``; needs ``embed_dim`` and ``num_heads`` in ``overrides``.
        overrides: config keys given as options (``embed_dim``, ``num_heads``, ``seq_len``,
            ``batch_size``, ``seed``); None values are ignored.
        at: test this one cut instead of all of them.
        with_controls: also run the two leaking controls on the built-in pipeline.
        progress: ``callback(done, total)``.
        max_memory, option_names: as for :func:`plan_intervene`.

    Raises:
        InputError: a config or option out of range.
        SetupError: the module cannot be loaded or its factory fails.
        ResourceError: the sizes would not fit in memory.
    """
    import torch

    from attn_ledger.maths.pipeline import make_input

    cfg, cuts = plan_intervene(config, module_spec=module_spec, overrides=overrides, at=at, max_memory=max_memory,
                               option_names=option_names)
    if module_spec is not None:
        from attn_ledger.inputs.userload import load_object

        factory = load_object(module_spec, "--module")
        with torch.random.fork_rng(devices=[]):
            manual_seed(cfg.seed)
            subject_module = build_module(factory, cfg.embed_dim, cfg.num_heads, "--module")
        return intervene_module(subject_module, module_task_args(cfg, module_spec, cuts, with_controls), progress)
    dtype = getattr(torch, cfg.dtype)
    x = make_input(cfg.batch_size, cfg.tq, cfg.embed_dim, cfg.input, cfg.seed, dtype)  # [B, T, E]
    subject_module, subject, note = _builtin_subject(cfg, dtype, with_controls)
    control_list = builtin_controls(cfg.embed_dim, cfg.num_heads, cfg.seed, x.dtype) if with_controls else []
    # Seed torch's own generator too, so that the same run gives the same report twice.
    with torch.random.fork_rng(devices=[]):
        manual_seed(cfg.seed)
        return intervene_report(subject_module, x, subject=subject, num_heads=cfg.num_heads, cuts=cuts,
                                controls=control_list, controls_note=note, seed=cfg.seed, progress=progress)


def _builtin_subject(cfg: Any, dtype: "torch.dtype", with_controls: bool) -> tuple["nn.Module", str, Note | None]:
    """The built-in pipeline a config describes, its name, and what its controls show."""
    from attn_ledger.errors import InputError
    from attn_ledger.maths.layer import BuiltinAttention

    relations = cfg.relations
    if relations not in (["none"], *[[m] for m in _CAUSAL_MASKS]):
        raise InputError(f"mask: got {str(cfg.mask)!r}, expected causal or none for intervene (the built-in module has no other mask)")
    causal = relations[0] in _CAUSAL_MASKS
    module = BuiltinAttention(cfg.embed_dim, cfg.num_heads, causal=causal, fault=cfg.fault, seed=cfg.seed, dtype=dtype)
    subject = "built-in pipeline" + (f", fault {cfg.fault}" if cfg.fault else "") + ("" if causal else ", mask none")
    return module, subject, BUILTIN_CONTROLS_NOTE if with_controls else None
