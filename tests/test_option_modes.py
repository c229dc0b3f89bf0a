"""Options that say no: every option against every mode of every command that has modes.

The table of which option each mode uses is written here, apart from the tool. An option a
mode does not use is exit 2 with one line naming it (never silently ignored); the options a
mode uses are accepted together (exit 0 or 1, never 2). ``faults`` has one mode, whose
options (--seed, --format, --output) it always uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app

runner = CliRunner()
ROOT = Path(__file__).parent.parent
KERNEL = str(ROOT / "fixtures/kernels/good.py:attention")
MODULE = str(ROOT / "fixtures/modules/attention_modules.py:causal_mha")
CASE = "b1-h2kv1-tq3tk4-dh4dv4-causal-flag-rand-f32"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("modes")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    torch.save({"q": q, "k": k, "v": v}, d / "qkv.pt")
    torch.save({"mask": torch.ones(5, 5, dtype=torch.bool).tril()}, d / "causal.pt")
    torch.save({"mask": torch.ones(2, 5, dtype=torch.bool)}, d / "padding.pt")
    (d / "segments.toml").write_text('mask = "segments"\nsegment_lengths = [2, 3]\n')
    return {"qkv": str(d / "qkv.pt"), "causal": str(d / "causal.pt"), "padding": str(d / "padding.pt"),
            "segments": str(d / "segments.toml"), "out": str(d / "report.json"), "plot": str(d / "plot.png"),
            "html": str(d / "report.html")}


# option -> its arguments (a flag alone, or the option and a value that suits every mode using it)
RUN_OPTIONS = {
    "--fault": ["--fault", "no-scale"], "--batch-size": ["--batch-size", "2"], "--seq-len": ["--seq-len", "5"],
    "--query-len": ["--query-len", "4", "--key-len", "5"], "--embed-dim": ["--embed-dim", "12"],
    "--num-heads": ["--num-heads", "3"], "--num-kv-heads": ["--num-kv-heads", "3"], "--value-dim": ["--value-dim", "4"],
    "--valid-lengths": ["--valid-lengths", "5,3"], "--window": ["--window", "2"], "--prefix-len": ["--prefix-len", "2"],
    "--empty-rows": ["--empty-rows", "zeros"], "--dtype": ["--dtype", "float64"], "--seed": ["--seed", "1"],
    "--input": ["--input", "arange"], "--device": ["--device", "cpu"], "--block-size": ["--block-size", "2"],
    "--keep-grids": ["--keep-grids"], "--keep-going": ["--keep-going"], "--backends": ["--backends", "math"],
    "--format": ["--format", "json"], "--output": ["--output", "{out}"], "--max-memory": ["--max-memory", "8G"],
    "--show": ["--show", "weights"], "--html": ["--html", "{html}"],
}
SIZE_OPTIONS = {"--batch-size", "--seq-len", "--query-len", "--embed-dim", "--num-heads", "--num-kv-heads", "--value-dim"}
EVERY_RUN = {"--empty-rows", "--dtype", "--device", "--block-size", "--keep-grids", "--keep-going", "--backends",
             "--format", "--output", "--max-memory", "--show", "--html"}
RELATION_OPTIONS = {"--valid-lengths": "padding", "--window": "sliding-window", "--prefix-len": "prefix-lm"}


def run_modes() -> dict[str, tuple[list[str], set[str]]]:
    """mode -> (the arguments that choose it, the options it uses)."""
    modes = {}
    for mask in ("none", "causal", "causal-top-left", "padding", "sliding-window", "prefix-lm", "causal+padding+sliding-window"):
        relation_opts = {o for o, rel in RELATION_OPTIONS.items() if rel in mask.split("+")}
        base = ["run", "--mask", mask] + (["--window", "2"] if "sliding-window" in mask else []) \
            + (["--prefix-len", "2"] if "prefix-lm" in mask else []) + (["--valid-lengths", "5,3"] if "padding" in mask else [])
        modes[f"config, mask {mask}"] = (base, EVERY_RUN | SIZE_OPTIONS | relation_opts | {"--fault", "--seed", "--input"})
    modes["config file, mask segments"] = (["run", "{segments}"], EVERY_RUN | SIZE_OPTIONS - {"--query-len"} | {"--fault", "--seed", "--input"})
    for mask in ("none", "sliding-window", "prefix-lm"):
        relation_opts = {o for o, rel in RELATION_OPTIONS.items() if rel == mask} - {"--valid-lengths"}
        base = ["run", "--tensors", "{qkv}", "--mask", mask] + (["--window", "2"] if mask == "sliding-window" else []) \
            + (["--prefix-len", "2"] if mask == "prefix-lm" else [])
        modes[f"tensors, mask {mask}"] = (base, EVERY_RUN | relation_opts)
    return modes


def fill(args: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in args]


def without_repeats(base: list[str], extra: list[str]) -> list[str]:
    """base + extra, an option given in base not given again."""
    return base + ([] if extra and extra[0] in base else extra)


def refused(args: list[str], option: str) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, (args, r.exit_code, r.output[-300:])
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in r.output, err
    assert option in err or option.lstrip("-").replace("-", "_") in err, (option, err)


def accepted(args: list[str]) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code in (0, 1), (args, r.exit_code, r.output[-400:])


RUN_MODES = run_modes()


@pytest.mark.parametrize("mode", list(RUN_MODES))
def test_run_every_option_against_the_mode(files, mode):
    base, uses = RUN_MODES[mode]
    base = fill(base, files)
    for option, extra in RUN_OPTIONS.items():
        if option not in uses and not (option == "--query-len" and "segments" in mode):
            refused(without_repeats(base, fill(extra, files)), option)
    together = [a for o in sorted(uses) if o not in ("--fault", "--query-len", "--show") for a in fill(RUN_OPTIONS[o], files)]
    accepted(_merge(base, together))
    accepted(_merge(base, RUN_OPTIONS["--show"]))  # heatmaps follow a table, so not with --format json
    if "--fault" in uses:  # a fault is a finding (exit 1), not a refusal
        accepted(_merge(base, RUN_OPTIONS["--fault"]))
    if "--query-len" in uses:  # cross-attention lengths replace --seq-len
        accepted(_merge(base, RUN_OPTIONS["--query-len"]))


def _merge(base: list[str], extra: list[str]) -> list[str]:
    """base with the options in extra added; an option base already has keeps base's value."""
    out = list(base)
    i = 0
    while i < len(extra):
        opt = extra[i]
        takes_value = i + 1 < len(extra) and not extra[i + 1].startswith("--")
        chunk = extra[i:i + 2] if takes_value else extra[i:i + 1]
        if opt not in out and not (opt == "--seq-len" and "--query-len" in out):
            out += chunk
        i += len(chunk)
    return out


def test_run_tensors_with_a_config_file_is_refused(files):
    refused(["run", files["segments"], "--tensors", files["qkv"]], "config")


def test_the_issue_example_valid_lengths_without_padding():
    r = runner.invoke(app, ["run", "--valid-lengths", "5,3"])
    assert r.exit_code == 2
    assert r.stderr.strip() == ("error: --valid-lengths: got [5, 3], expected it only with a mask that includes "
                                "'padding' (the mask is 'causal')")


@pytest.mark.parametrize("key,value,mask", [
    ("valid_lengths", "[5, 3]", "causal"), ("padding_side", '"left"', "causal"), ("window", "2", "causal"),
    ("prefix_len", "2", "causal+padding"), ("segment_lengths", "[2, 3]", "causal"),
])
def test_config_keys_the_mask_does_not_use_are_refused(tmp_path, key, value, mask):
    cfg = tmp_path / "c.toml"
    extra = "valid_lengths = [5, 3]\n" if "padding" in mask else ""
    cfg.write_text(f'mask = "{mask}"\n{key} = {value}\n{extra}')
    refused(["run", str(cfg)], key)


# --- sweep-scale, check, polarity, intervene, faults ----------------------------------------

SWEEP_OPTIONS = {"--dh": ["--dh", "8"], "--queries": ["--queries", "16"], "--keys": ["--keys", "16"],
                 "--seed": ["--seed", "1"], "--plot": ["--plot", "{plot}"], "--format": ["--format", "json"],
                 "--output": ["--output", "{out}"], "--max-memory": ["--max-memory", "8G"]}


@pytest.mark.parametrize("mode,base,uses", [
    ("sweep", ["sweep-scale"], set(SWEEP_OPTIONS)),
    ("tensors", ["sweep-scale", "--tensors", "{qkv}"], {"--plot", "--format", "--output", "--max-memory"}),
])
def test_sweep_scale_every_option_against_the_mode(files, mode, base, uses):
    pytest.importorskip("matplotlib")
    base = fill(base, files)
    for option, extra in SWEEP_OPTIONS.items():
        if option not in uses:
            refused(base + fill(extra, files), option)
    accepted(base + [a for o in sorted(uses) for a in fill(SWEEP_OPTIONS[o], files)])


DECODE_MODULE = str(ROOT / "fixtures/modules/decode_modules.py:plain")
DECODE = str(ROOT / "fixtures/modules/decode_modules.py:decode_list")
CHECK_OPTIONS = {"--embed-dim": ["--embed-dim", "12"], "--heads": ["--heads", "3"], "--causal": ["--causal"],
                 "--no-causal": ["--no-causal"], "--decode": ["--decode", DECODE], "--case": ["--case", CASE],
                 "--empty-rows": ["--empty-rows", "any"], "--seed": ["--seed", "1"], "--timeout": ["--timeout", "120"],
                 "--in-process": ["--in-process"], "--format": ["--format", "json"], "--output": ["--output", "{out}"],
                 "--timings": ["--timings"], "--html": ["--html", "{html}"], "--max-memory": ["--max-memory", "8G"],
                 "--window": ["--window", "6"], "--scale": ["--scale", "0.5"], "--softcap": ["--softcap", "50"],
                 "--batch-size": ["--batch-size", "3"],
                 "--seq-len": ["--seq-len", "5"],
                 "--full": ["--full"], "--backward": ["--backward"], "--no-backward": ["--no-backward"],
                 "--strict-precision": ["--strict-precision"], "--lenient-precision": ["--lenient-precision"],
                 "--strict-coverage": ["--strict-coverage"], "--lenient-coverage": ["--lenient-coverage"],
                 "--device": ["--device", "cpu"], "--dtypes": ["--dtypes", "float32"],
                 "--masks": ["--masks", "none,causal,mask"], "--gqa": ["--gqa"], "--no-gqa": ["--no-gqa"],
                 "--distinct-dv": ["--distinct-dv"], "--no-distinct-dv": ["--no-distinct-dv"],
                 "--max-tq": ["--max-tq", "16"], "--max-tk": ["--max-tk", "16"], "--head-dims": ["--head-dims", "4"]}
CHECK_EVERY = {"--seed", "--timeout", "--in-process", "--format", "--output", "--timings", "--html"}
# the kernel protocol's own options; of each pair of opposites, the walk gives one together with the rest
KERNEL_ONLY = {"--case", "--empty-rows", "--full", "--backward", "--no-backward", "--strict-precision",
               "--lenient-precision", "--strict-coverage", "--lenient-coverage", "--device", "--dtypes", "--masks",
               "--gqa", "--no-gqa", "--distinct-dv",
               "--no-distinct-dv", "--max-tq", "--max-tk", "--head-dims"}
OPPOSITES = {"--no-backward", "--lenient-precision", "--lenient-coverage", "--no-gqa", "--no-distinct-dv"}


@pytest.mark.parametrize("mode,base,uses", [
    ("kernel", ["check", KERNEL], CHECK_EVERY | KERNEL_ONLY),
    ("module", ["check", "--module", MODULE],
     CHECK_EVERY | {"--embed-dim", "--heads", "--causal", "--no-causal", "--decode", "--max-memory", "--window",
                    "--scale", "--softcap", "--batch-size", "--seq-len"}),
])
def test_check_every_option_against_the_mode(files, mode, base, uses):
    sizes = ["--embed-dim", "12", "--heads", "3"] if mode == "module" else []
    for option, extra in CHECK_OPTIONS.items():
        if option not in uses:
            refused(base + sizes + fill(extra, files), option.replace("--no-causal", "--causal"))
    chosen = [a for o in sorted(uses - {"--no-causal", "--embed-dim", "--heads", "--decode", "--window"} - OPPOSITES)
              for a in fill(CHECK_OPTIONS[o], files)]
    accepted(base + sizes + chosen)
    if mode == "kernel":
        # --no-gqa leaves out a grouped-query case (and an empty plan is exit 2): one with a kv head per query head
        accepted(base + ["--case", "b1-h1kv1-tq3tk4-dh4dv4-causal-flag-rand-f32"] + sorted(OPPOSITES))
    if mode == "module":
        accepted(base + sizes + ["--no-causal"])
        accepted(base + sizes + ["--window", "6"])  # a causal sliding window: not with --no-causal
        refused(base + sizes + ["--no-causal", "--window", "6"], "window")
        accepted(["check", "--module", DECODE_MODULE, "--decode", DECODE, "--embed-dim", "8", "--heads", "2"])


def test_list_cases_takes_no_target():
    accepted(["check", "--list-cases", "--format", "json"])
    refused(["check", KERNEL, "--list-cases"], "--list-cases")
    refused(["check", "--module", MODULE, "--list-cases"], "--list-cases")


def test_polarity_padding_side_only_with_expect_padding(files):
    refused(["polarity", "--padding-side", "left"], "--padding-side")
    refused(["polarity", "--mask", files["causal"], "--expect", "causal", "--padding-side", "left"], "--padding-side")
    accepted(["polarity", "--mask", files["padding"], "--expect", "padding", "--padding-side", "right"])
    refused(["polarity", "--expect", "causal"], "--expect")
    refused(["polarity", "--mask", files["causal"]], "--mask")


@pytest.mark.parametrize("base", [["intervene"], ["intervene", "--module", MODULE]])
def test_intervene_every_option_against_the_mode(base):
    common = ["--embed-dim", "12", "--heads", "3", "--seq-len", "4", "--batch-size", "1", "--seed", "2", "--at", "1",
              "--no-controls", "--format", "json", "--max-memory", "8G"]
    if "--module" in base:
        accepted(base + common + ["--timeout", "120"])
        accepted(base + common + ["--in-process"])
    else:  # the built-in pipeline runs no user code: the worker's options do not apply
        accepted(base + common)
        refused(base + ["--timeout", "5"], "--timeout")
        refused(base + ["--in-process"], "--in-process")
