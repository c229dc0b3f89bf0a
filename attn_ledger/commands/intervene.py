"""``attn-ledger intervene``: change only the future, rerun, and see whether the past moved."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute, spec_path
from attn_ledger.commands.options import INT
from attn_ledger.inputs.limits import MAX_POSITION


# config key -> the option that sets it, so a message about a key names what the user typed
OPTION_NAMES = {"embed_dim": "--embed-dim", "num_heads": "--heads", "seq_len": "--seq-len", "batch_size": "--batch-size",
                "seed": "--seed"}

# the options many commands share, with intervene's help text
SeedOption = opt.seed_option("Seeds the weights, the input and the replacement values; 0..2^63-1.")
TimeoutOption = opt.timeout_option(
    "With --module: limit on each call into your code (import, factory, each forward). A call past it is named "
    "in the report as an L1 call finding (exit 2 at import or factory time). Default 60; with --in-process, "
    "none unless given.")


def intervene(
    config: Annotated[Optional[Path], typer.Argument(help="TOML or JSON config for the built-in pipeline; omitted: the embedded default.")] = None,
    module: Annotated[Optional[str], typer.Option("--module", help="Test your module instead: path/to/file.py:FACTORY or pkg.mod:FACTORY, called as FACTORY(embed_dim, num_heads).")] = None,
    embed_dim: Annotated[Optional[str], typer.Option("--embed-dim", metavar=INT, help="E (required with --module).")] = None,
    heads: Annotated[Optional[str], typer.Option("--heads", metavar=INT, help="Nh (required with --module).")] = None,
    seq_len: Annotated[Optional[str], typer.Option("--seq-len", metavar=INT, help="T, at least 2.")] = None,
    batch_size: Annotated[Optional[str], typer.Option("--batch-size", metavar=INT, help="B.")] = None,
    seed: SeedOption = None,
    at: Annotated[Optional[str], typer.Option("--at", metavar=INT, help="Test one cut i (0..T-2) instead of all of them.")] = None,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Also run the two leaking controls on the built-in pipeline.")] = True,
    timeout: TimeoutOption = None,
    max_time: Annotated[Optional[float], typer.Option("--max-time", metavar="SECONDS", help="With --module: bound on the whole run, at most 86400; at expiry the forward in flight is stopped, an L1 call finding (exit 1). Default: no bound.")] = None,
    in_process: opt.in_process_option("With --module: run your code in this process, for debugging; sys.exit in it is still a finding, but a hang or a crash is not caught.") = False,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
    max_memory: Annotated[Optional[str], typer.Option("--max-memory", metavar="SIZE", help="Memory budget such as 8G or 512M (default: what the machine has free).")] = None,
) -> None:
    """Test causality by intervention: for each cut i, change only positions after i and rerun.

    Passes only if outputs at 0..i do not move (within the dtype's tolerance) while
    outputs after i clearly do, under no_grad and with autograd on. Two controls (masking
    off, mask in the wrong polarity) must fail, or the test has no power. Also reports
    whether two eval-mode calls agree bitwise. A --module runs in a worker process: a forward
    that hangs, exits or crashes is an L1 call finding, and what it prints goes to stderr.
    """

    def build() -> Any:
        from attn_ledger.errors import InputError
        from attn_ledger.experiments.intervene import module_task_args, plan_intervene, run_intervene

        overrides = {"embed_dim": opt.integer(embed_dim, "--embed-dim"), "num_heads": opt.integer(heads, "--heads"),
                     "seq_len": opt.integer(seq_len, "--seq-len"), "batch_size": opt.integer(batch_size, "--batch-size"),
                     "seed": opt.seed(seed)}
        cut = opt.integer(at, "--at", 0, MAX_POSITION)
        budget = opt.memory(max_memory)
        if module is None:
            if timeout is not None or max_time is not None or in_process:
                raise InputError("--timeout/--max-time/--in-process: apply only with --module "
                                 "(the built-in pipeline runs no code of yours)")
            with Progress("intervening") as bar:
                return run_intervene(config, overrides=overrides, at=cut, with_controls=controls, progress=bar,
                                     max_memory=budget, option_names=OPTION_NAMES)
        from attn_ledger.inputs.userload import parse_spec
        from attn_ledger.runner.worker import Limits, run_user_task, show_output

        limits = Limits(max_time=max_time)
        cfg, cuts = plan_intervene(config, module_spec=module, overrides=overrides, at=cut, max_memory=budget,
                                   option_names=OPTION_NAMES)
        parse_spec(module, "--module")
        with Progress("intervening") as bar:
            outcome = run_user_task("intervene_module", module_task_args(cfg, module, cuts, controls),
                                    in_process=in_process, timeout=timeout, progress=bar, limits=limits)
        show_output(outcome.output)
        return outcome.report

    execute(build, output_format, output, command="intervene", detail=detail, inputs={"config": config, "--module": spec_path(module)})
