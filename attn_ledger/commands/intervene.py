"""``attn-ledger intervene``: change only the future, rerun, and see whether the past moved."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from attn_ledger.commands.common import Format, Progress, execute

_CAUSAL_MASKS = ("causal", "causal-top-left")


def intervene(
    config: Annotated[Optional[Path], typer.Argument(help="TOML or JSON config for the built-in pipeline; omitted: the embedded default.")] = None,
    module: Annotated[Optional[str], typer.Option("--module", help="Test your module instead: path/to/file.py:FACTORY or pkg.mod:FACTORY, called as FACTORY(embed_dim, num_heads).")] = None,
    embed_dim: Annotated[Optional[int], typer.Option("--embed-dim", help="E (required with --module).")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="Nh (required with --module).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="T, at least 2.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="B.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seeds the weights, the input and the replacement values.")] = None,
    at: Annotated[Optional[int], typer.Option("--at", help="Test one cut i (0..T-2) instead of all of them.")] = None,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Also run the two leaking controls on the built-in pipeline.")] = True,
    output_format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file.")] = None,
) -> None:
    """Test causality by intervention: for each cut i, change only positions after i and rerun.

    Passes only if outputs at 0..i do not move (within the dtype's tolerance) while
    outputs after i clearly do, under no_grad and with autograd on. Two controls (masking
    off, mask in the wrong polarity) must fail, or the test has no power. Also reports
    whether two eval-mode calls agree bitwise.
    """

    def build() -> Any:
        return _build(config, module, embed_dim, heads, seq_len, batch_size, seed, at, controls)

    execute(build, output_format, output)


def _build(config, module_spec, embed_dim, heads, seq_len, batch_size, seed, at, with_controls) -> Any:
    import torch

    from attn_ledger.config import load_config
    from attn_ledger.errors import InputError
    from attn_ledger.experiments.intervene import builtin_controls, intervene_report
    from attn_ledger.pipeline import make_input

    if module_spec is not None and (embed_dim is None or heads is None):
        raise InputError("--module needs --embed-dim and --heads: the factory is called as FACTORY(embed_dim, num_heads)")
    overrides = {"embed_dim": embed_dim, "num_heads": heads, "seq_len": seq_len, "batch_size": batch_size, "seed": seed}
    cfg = load_config(config, overrides)
    if cfg.tq != cfg.tk:
        raise InputError(f"intervene needs self-attention: got query_len={cfg.tq}, key_len={cfg.tk}, expected seq_len")
    t = cfg.tq
    if t < 2:
        raise InputError(f"seq_len: got {t}, expected at least 2 (a cut needs a position on each side)")
    if cfg.batch_size < 1:
        raise InputError(f"batch_size: got {cfg.batch_size}, expected at least 1")
    if at is not None and not 0 <= at <= t - 2:
        raise InputError(f"--at: got {at}, expected a cut between 0 and seq_len-2={t - 2}")
    dtype = getattr(torch, cfg.dtype)
    x = make_input(cfg.batch_size, t, cfg.embed_dim, cfg.input, cfg.seed, dtype)  # [B, T, E]
    cuts = None if at is None else [at]

    if module_spec is None:
        from attn_ledger.model import BuiltinAttention

        relations = cfg.relations
        if relations not in (["none"], *[[m] for m in _CAUSAL_MASKS]):
            raise InputError(f"mask: got {cfg.mask!r}, expected causal or none for intervene (the built-in module has no other mask)")
        causal = relations[0] in _CAUSAL_MASKS
        subject_module = BuiltinAttention(cfg.embed_dim, cfg.num_heads, causal=causal, fault=cfg.fault, seed=cfg.seed, dtype=dtype)
        subject = "built-in pipeline" + (f", fault {cfg.fault}" if cfg.fault else "") + ("" if causal else ", mask none")
        control_list = builtin_controls(cfg.embed_dim, cfg.num_heads, cfg.seed, dtype) if with_controls else []
        note = ("two leaking versions of the same pipeline; each must be reported as a leak" if with_controls
                else "skipped (--no-controls): nothing here shows the test can fail")
    else:
        from attn_ledger.modulecheck import build_module
        from attn_ledger.userload import load_object

        factory = load_object(module_spec, "--module")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            subject_module = build_module(factory, cfg.embed_dim, cfg.num_heads)
        x = x.to(_module_dtype(subject_module, dtype))
        subject = f"module {module_spec}"
        control_list = builtin_controls(cfg.embed_dim, cfg.num_heads, cfg.seed, x.dtype) if with_controls else []
        note = ("run on the built-in pipeline at the same sizes, which shows the probe can fail here; no fault can be "
                "injected into your module, so its own result stands alone" if with_controls
                else "skipped (--no-controls); no fault can be injected into your module, so its result stands alone")
    # Seed torch's own generator too, so a module that draws random numbers in its forward
    # (dropout left on) gives the same report twice.
    with Progress("intervening") as progress, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return intervene_report(subject_module, x, subject=subject, num_heads=cfg.num_heads, cuts=cuts,
                                controls=control_list, controls_note=note, seed=cfg.seed, progress=progress)


def _module_dtype(module: Any, default: Any) -> Any:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return default
