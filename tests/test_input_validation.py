"""Input that a careless or hostile user gives: strict types, bounded configs, files of the
wrong kind, unreadable paths, empty batches, messages cut to a readable length."""

from __future__ import annotations

import errno
import json
import pathlib
import pickle
import zipfile

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config, nesting_depth
from attn_ledger.errors import ConfigError
from attn_ledger.inputs.tensorio import save_tensor_file

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_line_exit_2(r) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in r.output
    return err


def qkv(b: int = 2, nh: int = 2, t: int = 4, d: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(b, nh, t, d, generator=g) for n in ("q", "k", "v")}


# --- strict types ------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [
    ("seq_len", True), ("seq_len", 5.0), ("seq_len", "5"), ("batch_size", False), ("embed_dim", 12.5),
    ("valid_lengths", [True, 3]), ("keep_grids", 1), ("window", "2"), ("seed", 1e3),
])
def test_config_values_of_the_wrong_type_are_refused(tmp_path, key, value):
    cfg = tmp_path / "c.json"
    extra = {"mask": "causal+padding"} if key == "valid_lengths" else {"mask": "sliding-window"} if key == "window" else {}
    cfg.write_text(json.dumps({key: value, **extra}))
    err = one_line_exit_2(invoke("run", str(cfg)))
    assert err.startswith(f"error: {key}")  # valid_lengths.0 names the entry


@pytest.mark.parametrize("option,value", [
    ("--seq-len", "５"), ("--seq-len", "5.0"), ("--seq-len", "1e3"), ("--seq-len", "0x10"), ("--seq-len", "1_000"),
    ("--batch-size", "two"), ("--embed-dim", "١٢"), ("--valid-lengths", "５,3"), ("--block-size", ""),
])
def test_options_take_ascii_digits_only(option, value):
    args = ["run", option, value] + (["--mask", "padding"] if option == "--valid-lengths" else [])
    err = one_line_exit_2(invoke(*args))
    assert option in err


def test_a_mask_of_100001_parts_is_refused_and_echoed_short():
    err = one_line_exit_2(invoke("run", "--mask", "+".join(["causal"] * 100_001)))
    assert "--mask" in err and len(err) < 300


def test_mask_part_count_is_bounded_below_the_length_limit():
    err = one_line_exit_2(invoke("run", "--mask", "+".join(["none"] * 9)))
    assert "at most 8" in err


def test_a_50_mb_option_value_is_cut_in_the_message():
    huge = "7" * (50 << 20)
    for args in (["run", "--mask", huge], ["run", "--seq-len", huge], ["run", "--valid-lengths", huge, "--mask", "padding"],
                 ["sweep-scale", "--dh", huge]):
        err = one_line_exit_2(invoke(*args))
        assert len(err) < 400, (args[1], len(err))


# --- config files ------------------------------------------------------------------------

def test_a_5000_digit_json_integer_is_refused(tmp_path):
    cfg = tmp_path / "big.json"
    cfg.write_text('{"seed": ' + "9" * 5000 + "}")
    err = one_line_exit_2(invoke("run", str(cfg)))
    assert "5000 digits" in err


def test_a_5000_digit_toml_integer_is_refused(tmp_path):
    cfg = tmp_path / "big.toml"
    cfg.write_text("seed = " + "9" * 5000 + "\n")
    one_line_exit_2(invoke("run", str(cfg)))
    cfg.write_text("seed = " + "9" * 200 + "\n")  # converts, but longer than any size or seed
    assert "200 digits" in one_line_exit_2(invoke("run", str(cfg)))


@pytest.mark.parametrize("suffix,text", [
    (".json", "[" * 10_000 + "]" * 10_000),
    (".json", '{"mask": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    (".toml", "a = " + "[" * 10_000 + "]" * 10_000 + "\n"),
    (".toml", "a = " + "{b = " * 10_000 + "1" + "}" * 10_000 + "\n"),
])
def test_config_nested_10000_deep_is_refused(tmp_path, suffix, text):
    cfg = tmp_path / f"deep{suffix}"
    cfg.write_text(text)
    assert "nests" in one_line_exit_2(invoke("run", str(cfg)))


DOTTED = ".".join(["a"] * 1000)


@pytest.mark.parametrize("text", [f"[{DOTTED}]\nx = 1\n", f"{DOTTED} = 1\n", f"[[{DOTTED}]]\nx = 1\n",
                                  "[a.b.c.d.e.f.g.h]\nx = [1]\n"],
                         ids=["table-header", "dotted-key", "array-of-tables", "nine-levels"])
def test_toml_nested_by_dotted_keys_and_headers_is_refused(tmp_path, text):
    # No bracket per level, so the text scan cannot see it: the parsed tables are measured too.
    cfg = tmp_path / "deep.toml"
    cfg.write_text(text)
    assert one_line_exit_2(invoke("run", str(cfg))) == (
        f"error: config: {str(cfg)!r} nests lists or tables (dotted keys and table headers included) more than 8 deep, "
        "expected at most 8 levels")


def test_toml_headers_eight_deep_are_read(tmp_path):
    from attn_ledger.inputs.config import read_config_file

    path = tmp_path / "ok.toml"
    path.write_text("[a.b.c.d.e.f.g]\nx = [1]\n")  # 8 levels, the bound: read
    assert read_config_file(path)["a"]["b"]["c"]["d"]["e"]["f"]["g"] == {"x": [1]}


def test_nesting_depth_skips_strings_and_comments():
    assert nesting_depth('{"mask": "[[[[[[[[[[[[["}') == 1
    assert nesting_depth("a = 1 # [[[[[[[[[[[[[[[\nb = [[1]]") == 2
    assert nesting_depth(r'{"a": "\"[[[[[[[[[[[[[[["}') == 1


def test_a_config_over_a_mebibyte_is_refused(tmp_path):
    cfg = tmp_path / "big.toml"
    cfg.write_text("# " + "x" * (1 << 20) + "\n")
    assert "bytes" in one_line_exit_2(invoke("run", str(cfg)))


def test_seq_len_true_does_not_run_with_t_1(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"seq_len": true}')
    err = one_line_exit_2(invoke("run", str(cfg)))
    assert err == "error: seq_len: got True, expected a valid integer"


def test_window_and_prefix_beyond_the_keys_are_refused():
    with pytest.raises(ConfigError):
        load_config(None, {"mask": "sliding-window", "window": 10**30})
    with pytest.raises(ConfigError):
        load_config(None, {"mask": "prefix-lm", "prefix_len": 6})
    assert load_config(None, {"mask": "prefix-lm", "prefix_len": 5}).prefix_len == 5


# --- paths -------------------------------------------------------------------------------

@pytest.fixture
def unsearchable(monkeypatch, tmp_path):
    """A directory whose entries cannot be reached (as for a user without search permission on it;
    the tests may run as root, who is never refused, so the refusal is made here)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_stat = pathlib.Path.stat

    def stat(self, *args, **kwargs):
        if locked in self.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    return locked


@pytest.mark.parametrize("args", [
    lambda d: ["run", str(d / "c.toml")],
    lambda d: ["run", "--tensors", str(d / "t.pt")],
    lambda d: ["sweep-scale", "--tensors", str(d / "t.pt")],
    lambda d: ["polarity", "--mask", str(d / "m.pt"), "--expect", "causal"],
    lambda d: ["check", str(d / "k.py") + ":attention", "--case", "b1-h1kv1-tq2tk2-dh4dv4-none-rand-f32"],
    lambda d: ["check", "--module", str(d / "m.py") + ":factory", "--embed-dim", "4", "--heads", "1"],
    lambda d: ["intervene", "--module", str(d / "m.py") + ":factory", "--embed-dim", "4", "--heads", "1"],
], ids=["config", "run-tensors", "sweep-tensors", "polarity-mask", "check-kernel", "check-module", "intervene-module"])
def test_a_path_in_an_unsearchable_directory_is_one_line(unsearchable, args):
    err = one_line_exit_2(invoke(*args(unsearchable)))
    assert "permission denied" in err


def test_a_plot_in_an_unsearchable_directory_is_one_line(unsearchable):
    pytest.importorskip("matplotlib")
    err = one_line_exit_2(invoke("sweep-scale", "--dh", "8", "--queries", "8", "--keys", "8",
                                 "--plot", str(unsearchable / "sub" / "p.png")))
    assert "--plot" in err


def test_a_directory_given_as_a_file_is_one_line(tmp_path):
    assert "a directory" in one_line_exit_2(invoke("run", "--tensors", str(tmp_path / ".")))
    d = tmp_path / "c.toml"
    d.mkdir()
    assert "a directory" in one_line_exit_2(invoke("run", str(d)))


# --- tensor files: what they are, said plainly ------------------------------------------

def write(path: pathlib.Path, data: bytes) -> pathlib.Path:
    path.write_bytes(data)
    return path


def kinds(tmp: pathlib.Path) -> dict[str, tuple[pathlib.Path, str]]:
    t = qkv()
    out: dict[str, tuple[pathlib.Path, str]] = {}
    out["random bytes"] = (write(tmp / "r.pt", bytes(range(256)) * 4), "not a pickle, a zip archive or a safetensors file")
    np.save(tmp / "bare.npy", np.ones(3))
    out["bare npy"] = (write(tmp / "bare.npz", (tmp / "bare.npy").read_bytes()), "a bare .npy array")
    save_tensor_file(t, tmp / "st.safetensors")
    out["safetensors as pt"] = (write(tmp / "st.pt", (tmp / "st.safetensors").read_bytes()), "a safetensors file")
    save_tensor_file(t, tmp / "a.npz")
    out["npz as pt"] = (write(tmp / "a.pt", (tmp / "a.npz").read_bytes()), "an .npz archive")
    save_tensor_file(t, tmp / "b.pt")
    out["pt as npz"] = (write(tmp / "b.npz", (tmp / "b.pt").read_bytes()), "a torch.save archive")
    out["pt as safetensors"] = (write(tmp / "b.safetensors", (tmp / "b.pt").read_bytes()), "a torch.save archive")
    with open(tmp / "p4.pt", "wb") as fh:
        pickle.dump(t, fh, protocol=4)
    out["plain pickle"] = ((tmp / "p4.pt"), "a plain pickle (protocol 4)")
    out["empty"] = (write(tmp / "e.pt", b""), "an empty file")
    with zipfile.ZipFile(tmp / "z.pt", "w") as z:
        z.writestr("readme.txt", "hello")
    out["other zip"] = (tmp / "z.pt", "a zip archive")
    return out


def test_a_tensor_file_of_another_kind_is_named_for_what_it_is(tmp_path):
    for name, (path, needle) in kinds(tmp_path).items():
        r = invoke("run", "--tensors", str(path))
        err = one_line_exit_2(r)
        assert needle in err, (name, err)
        assert "Warning" not in r.stderr, name


def test_a_hostile_pickle_inside_a_torch_archive_is_refused_without_running(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.pt"
    torch.save({"q": Evil()}, path)
    r = invoke("run", "--tensors", str(path))
    assert "weights_only" in one_line_exit_2(r)
    assert "this must never run" not in r.output


@pytest.mark.parametrize("make,needle", [
    (lambda: torch.randn(2, 4, 8).to_sparse(), "sparse tensor"),
    (lambda: torch.empty(2, 4, 8, device="meta"), "meta device"),
])
def test_saved_sparse_or_meta_tensors_are_refused(tmp_path, make, needle):
    t = {**qkv(nh=1), "q": make()}
    t = {k: v[:, 0] if v.dim() == 4 else v for k, v in t.items()}
    path = tmp_path / "x.pt"
    torch.save(t, path)
    for command in (["run", "--tensors", str(path)], ["sweep-scale", "--tensors", str(path)]):
        assert needle in one_line_exit_2(invoke(*command))


# --- empty batches --------------------------------------------------------------------------

def test_batch_0_with_a_padding_mask_runs():
    r = invoke("run", "--batch-size", "0", "--mask", "padding", "--valid-lengths", "", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["verdict"] == "pass"


@pytest.mark.parametrize("mask_key,mask", [
    ("key_valid", torch.ones(0, 4, dtype=torch.bool)),
    ("allow_mask", torch.ones(0, 4, 4, dtype=torch.bool)),
    ("allow_mask", torch.ones(4, 4, dtype=torch.bool).tril()),
])
def test_saved_batch_0_tensors_with_masks_run(tmp_path, mask_key, mask):
    path = tmp_path / "b0.pt"
    torch.save({**qkv(b=0), mask_key: mask}, path)
    r = invoke("run", "--tensors", str(path), "--format", "json")
    assert r.exit_code == 0, r.output


def test_sweep_scale_on_a_batch_0_file_runs(tmp_path):
    path = tmp_path / "b0.pt"
    torch.save({"q": torch.randn(0, 4, 8), "k": torch.randn(0, 4, 8)}, path)
    r = invoke("sweep-scale", "--tensors", str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    details = json.loads(r.stdout)["details"]
    assert (details["saturated_rows"], details["total_rows"]) == (0, 0)


# --- check: case ids and time limits, bounded before any conversion ------------------------

GOOD_KERNEL = str(pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hostile" / "kernels.py") + ":good"
LONG = "1" * 10_000


@pytest.mark.parametrize("case_id, field, digits", [
    (f"b1-h1kv1-tq{LONG}tk1-dh4dv4-none-rand-f32", "Tq", 10_000),
    (f"b{LONG}-h1kv1-tq1tk1-dh4dv4-none-rand-f32", "B", 10_000),
    (f"b1-h1kv1-tq1tk9-dh4dv4-lpad{LONG}-rand-f32", "left padding N (lpadN)", 10_000),
    (f"b1-h1kv1-tq1tk9-dh4dv4-gap1x{LONG}-causal-rand-f32", "blocked run length L (gapSxL)", 10_000),
    (f"b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32-s1{LONG}", "scale (-sSCALE)", 10_001),
    ("b1-h1kv1-tq123456789tk1-dh4dv4-none-rand-f32", "Tq", 9),
], ids=["tq", "b", "lpad", "gap", "scale", "nine-digits"])
def test_a_case_id_with_a_long_number_is_one_line_naming_the_field(case_id, field, digits):
    err = one_line_exit_2(invoke("check", GOOD_KERNEL, "--case", case_id))
    most = 16 if field.startswith("scale") else 8
    assert f": {field} got '" in err and err.endswith(f"of {digits} digits, expected at most {most} digits")
    assert len(err) < 300  # the id and the number are cut


def test_a_case_id_with_short_numbers_still_gets_the_range_message():
    err = one_line_exit_2(invoke("check", GOOD_KERNEL, "--case", "b1-h1kv1-tq99999999tk1-dh4dv4-none-rand-f32"))
    assert err == "error: case 'b1-h1kv1-tq99999999tk1-dh4dv4-none-rand-f32': Tq=99999999, expected between 1 and 4096"


@pytest.mark.parametrize("value", ["1e10", "86401", "1e308"])
def test_timeout_is_at_most_a_day(value):
    err = one_line_exit_2(invoke("check", GOOD_KERNEL, "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32",
                                 "--timeout", value))
    assert err == (f"error: --timeout: got {float(value)!r}, expected a number of seconds > 0 and at most 86,400 "
                   "(one day)")


def test_a_timeout_of_a_day_is_taken():
    from attn_ledger.runner.worker import check_timeout

    check_timeout(86_400)  # no error: the bound itself is allowed
    from attn_ledger.errors import InputError

    with pytest.raises(InputError, match="at most 86,400"):
        check_timeout(86_400.5)


# --- check: a target that cannot take the protocol's arguments is bad setup ----------------

TARGETS = '''
import functools
import sys

import torch

builtin = torch.matmul
partial = functools.partial(torch.matmul)


def raises_type_error(q, k, v, **kw):
    return q + "x"  # the user's own TypeError, from inside the call: a finding


def calls_a_builtin_wrongly(q, k, v, **kw):
    return torch.matmul(q, k, v)  # also from inside the user's code: a finding


class _NoSignature:
    @property
    def __signature__(self):
        raise ValueError("no signature")  # as a builtin has none: the arguments are probed by a call


class _Exits(_NoSignature):
    def __call__(self, q, k, v, **kw):
        sys.exit(3)


exits = _Exits()
'''
ONE_CASE = "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"


@pytest.fixture
def targets(tmp_path):
    src = tmp_path / "targets.py"
    src.write_text(TARGETS)
    return src


@pytest.mark.parametrize("name", ["builtin", "partial"])
def test_a_builtin_that_cannot_take_the_protocols_arguments_is_exit_2(targets, name):
    err = one_line_exit_2(invoke("check", f"{targets}:{name}", "--case", ONE_CASE))
    assert err == (f"error: target: {targets}:{name} cannot take the kernel protocol's arguments "
                   "(q, k, v, allow_mask=, is_causal=, scale=): the first call raised TypeError: matmul() takes 2 "
                   "positional arguments but 3 were given; wrap it in an adapter (see 'Adapters' in docs/check.md)")


def test_a_target_that_exits_on_the_argument_probe_is_exit_2(targets):
    err = one_line_exit_2(invoke("check", f"{targets}:exits", "--case", ONE_CASE, "--timeout", "30"))
    assert err == f"error: target: {targets}:exits: the argument probe raised SystemExit(3)"


@pytest.mark.parametrize("name, message", [
    ("raises_type_error", "raised TypeError: unsupported operand type(s) for +: 'Tensor' and 'str'"),
    ("calls_a_builtin_wrongly", "raised TypeError: matmul() takes 2 positional arguments but 3 were given"),
])
def test_a_type_error_from_inside_the_users_code_stays_a_finding(targets, name, message):
    r = invoke("check", f"{targets}:{name}", "--case", ONE_CASE, "--format", "json")
    assert r.exit_code == 1, r.output
    first = json.loads(r.stdout)["first_finding"]
    assert (first["level"], first["check"]) == (1, "call") and first["message"].endswith(message)
