"""The judge apart from the judged: kernels that try to get past ``check`` fail on the check built for them.

Each hostile kernel (fixtures/hostile/judge_*.py) runs through the CLI, in a worker, on a case where
the correct kernel it is built from passes every check; the test names the one check that must
catch it and shows that no other check fails first. The driver's own pieces (plain outputs, the
global-state watch, rebuilt exceptions) are tested here too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "fixtures" / "hostile"
CASE = "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32"  # a mask, GQA, Dv != Dh: every input kind a kernel can clobber
runner = CliRunner()


def check(name: str, *extra: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["check", f"{HOSTILE / name}.py:attention", "--case", CASE, "--format", "json",
                              "--timeout", "30", *extra])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def failing(report: dict) -> set[str]:
    return {c["name"] for row in report["rows"] for c in row["checks"] if c["status"] == "fail"}


def test_the_kernel_they_are_built_from_passes_the_case_with_and_without_backward():
    for extra in ((), ("--no-backward",)):
        res = runner.invoke(app, ["check", f"{HOSTILE / 'judge_common.py'}:good", "--case", CASE, "--format", "json",
                                  *extra])
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout)
        statuses = {c["name"]: c["status"] for c in report["rows"][0]["checks"]}
        assert statuses["inputs_unchanged"] == "pass" and statuses["reference_grad_mode"] == "pass"
        assert statuses["grad_call"] == ("skipped" if extra else "pass")


@pytest.mark.parametrize("name", ["judge_subclass", "judge_patched_softmax", "judge_patch_check_case",
                                  "judge_patch_reference"])
def test_a_broken_kernel_that_reaches_into_its_judge_fails_reference(name):
    code, report = check(name, "--no-backward")
    assert code == 1
    assert report["first_finding"]["check"] == "reference" and report["first_finding"]["level"] == 4
    # the same scale fault shows under grad mode too; nothing below L4 fails
    assert failing(report) == {"reference", "reference_grad_mode"}


def test_a_returned_subclass_is_judged_as_a_plain_tensor_and_named():
    code, report = check("judge_subclass", "--no-backward")
    assert code == 1 and report["first_finding"]["value"] > 1e-3  # the subclass did not decide its own comparison
    assert report["details"]["returned_subclass"] == {"cases": 1, "types": ["Agreeable"]}
    assert any("returned a tensor subclass (Agreeable)" in n for n in report["notes"])
    call = next(c for c in report["rows"][0]["checks"] if c["name"] == "call")
    assert call["status"] == "pass" and call["data"]["returned_subclass"] == "Agreeable"


def test_patched_torch_functions_are_reported():
    code, report = check("judge_patched_softmax", "--no-backward")
    assert report["details"]["global_state"]["replaced"] == ["torch.Tensor.softmax", "torch.softmax"]
    assert any(n.startswith("your code changed torch's global state: replaced torch.Tensor.softmax, torch.softmax")
               for n in report["notes"])


def test_an_unreadable_dispatch_wrapper_is_an_l1_call_finding_naming_its_type():
    code, report = check("judge_dispatch_wrapper")
    assert code == 1 and failing(report) == {"call"}
    reason = report["first_finding"]["message"]
    assert "returned a Opaque, a __torch_dispatch__ wrapper subclass" in reason


@pytest.mark.parametrize("extra", [(), ("--no-backward",)], ids=["backward", "no-backward"])
def test_output_that_depends_on_grad_mode_fails_reference_grad_mode(extra):
    code, report = check("judge_grad_mode", *extra)
    assert code == 1 and failing(report) == {"reference_grad_mode"}
    assert report["first_finding"]["check"] == "reference_grad_mode"
    assert report["first_finding"]["value"] == pytest.approx(1.0, abs=1e-5)


def test_a_detached_output_fails_grad_call_no_gradient_reaches_qkv():
    code, report = check("judge_detached")
    assert code == 1 and failing(report) == {"grad_call"}
    assert report["first_finding"]["message"] == "no gradient reaches q, k, v: the output carries no gradient (no grad_fn)"


def test_a_detached_output_declared_inference_only_passes():
    code, report = check("judge_detached", "--no-backward")
    assert code == 0


@pytest.mark.parametrize("extra", [(), ("--no-backward",)], ids=["backward", "no-backward"])
def test_clobbered_inputs_fail_inputs_unchanged(extra):
    code, report = check("judge_clobbers", *extra)
    assert code == 1 and failing(report) == {"inputs_unchanged"}
    first = report["first_finding"]
    assert first["check"] == "inputs_unchanged" and first["level"] == 1
    assert "the call changed its inputs in place: q, k, v, allow_mask (in attention(" in first["message"]
    check_data = next(c for c in report["rows"][0]["checks"] if c["name"] == "inputs_unchanged")["data"]
    assert check_data["changed"] == ["q", "k", "v", "allow_mask"]


def check_module(spec: str, *extra: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["check", "--module", f"{HOSTILE / spec}", "--embed-dim", "8", "--heads", "2",
                              "--format", "json", "--timeout", "60", *extra])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def test_the_module_they_are_built_from_fails_effective_scale_and_attention_core_only():
    code, report = check_module("judge_modules_common.py:no_scale")
    assert code == 1 and report["first_finding"]["check"] == "effective_scale"
    assert failing(report) == {"effective_scale", "attention_core"}


@pytest.mark.parametrize("spec", ["judge_patch_module_check.py:factory", "judge_module_patches.py:patched_audit",
                                  "judge_module_patches.py:patched_fit"],
                         ids=["check_built_module", "coreaudit.audit_core", "corefit.fit_scores+reference_context"])
def test_a_module_factory_that_patches_the_module_check_fails(spec):
    """The factory patches the tool where it runs (the worker); the module is judged in the parent, so
    the patch changes nothing: the module's own findings stand, the first at L4 effective_scale."""
    code, report = check_module(spec)
    assert code == 1
    assert report["first_finding"]["check"] == "effective_scale" and report["first_finding"]["level"] == 4
    assert report["first_finding"]["value"] == pytest.approx(1.0, rel=1e-3)  # unscaled: 1, not 1/sqrt(Dh) = 0.5
    assert failing(report) == {"effective_scale", "attention_core"}


def test_a_module_factory_that_patches_the_module_check_fools_only_an_in_process_check(monkeypatch):
    """``--in-process`` runs the factory where the module is judged, by design (documented as exempt)."""
    import attn_ledger.probes.module.core as coreaudit
    import attn_ledger.probes.module.fit as corefit

    for space, name in ((coreaudit, "fit_scores"), (corefit, "fit_scores"), (coreaudit, "reference_context")):
        monkeypatch.setattr(space, name, getattr(space, name))  # put back after the test: the factory patches them
    code, report = check_module("judge_module_patches.py:patched_fit", "--in-process")
    assert code == 0


# --- the driver's pieces ------------------------------------------------------------------------------


def test_plain_output_makes_a_function_subclass_plain_before_anything_reads_it():
    import torch

    from attn_ledger.probes.common.driver import plain_output

    class Liar(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return torch.zeros(1)  # every operation lies

    out, facts = plain_output(torch.arange(4.0).as_subclass(Liar))
    assert type(out) is torch.Tensor and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert facts["subclass"].endswith("Liar") and "error" not in facts


def test_plain_output_materialises_a_wrapper_with_full_tensor_and_names_one_without():
    import torch

    from attn_ledger.probes.common.driver import plain_output

    class Sharded(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

        def full_tensor(self):
            return self.inner * 1

    out, facts = plain_output(Sharded(torch.ones(2, 3)))
    assert type(out) is torch.Tensor and out.shape == (2, 3) and facts["subclass"].endswith("Sharded")
    del Sharded.full_tensor
    out, facts = plain_output(Sharded(torch.ones(2, 3)))
    assert out is None and "__torch_dispatch__ wrapper subclass" in facts["error"]["text"]


def test_state_changes_name_flags_and_replaced_callables_and_nothing_else():
    import torch

    from attn_ledger.probes.common.driver import snapshot, state_changes

    before = snapshot()
    assert state_changes(before) == {}
    saved = torch.Tensor.exp
    torch.Tensor.exp = lambda self: self
    torch.set_default_dtype(torch.float64)
    try:
        changed = state_changes(before)
        assert changed["replaced"] == ["torch.Tensor.exp"]
        assert changed["flags"] == {"default_dtype": ["float32", "float64"]}
        assert "replaced" not in state_changes(before, callables=False)
    finally:
        torch.Tensor.exp = saved
        torch.set_default_dtype(torch.float32)
    assert state_changes(before) == {}


def test_a_rebuilt_exception_keeps_its_type_name_message_and_builtin_base():
    from attn_ledger.guard import rebuilt_exception

    exc = rebuilt_exception({"type": "MyError", "bases": ["TypeError", "Exception"], "message": "bad 'scale'"})
    assert isinstance(exc, TypeError) and type(exc).__name__ == "MyError" and str(exc) == "bad 'scale'"
    assert type(rebuilt_exception({"type": "ValueError", "bases": ["ValueError"], "message": "x"})) is ValueError
    odd = rebuilt_exception({"type": "not a name", "bases": [], "message": "x"})
    assert type(odd).__name__ == "Exception"


def test_a_kernel_that_disables_grad_at_import_is_checked_normally(tmp_path):
    path = tmp_path / "nograd.py"
    path.write_text("import torch\nimport sys\nsys.path.insert(0, %r)\nfrom judge_common import good as attention\n"
                    "torch.set_grad_enabled(False)\n" % str(HOSTILE))
    res = runner.invoke(app, ["check", f"{path}:attention", "--case", CASE, "--format", "json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["details"]["global_state"] == {"flags": {"grad_enabled": [True, False]}}


def test_the_tools_process_never_imports_the_users_file():
    import sys

    import attn_ledger.probes.kernel.check as kernelcheck
    import attn_ledger.probes.kernel.reference as kernelref

    before = (kernelcheck._check_case, kernelref.attention, set(sys.modules))
    code, report = check("judge_patch_check_case", "--no-backward")
    assert code == 1  # the patch ran in the worker, where nothing is judged
    assert (kernelcheck._check_case, kernelref.attention) == before[:2]
    assert not [m for m in set(sys.modules) - before[2] if m.startswith("_attn_ledger_user_") or "judge_" in m]


# --- the module driver's pieces -------------------------------------------------------------------------


def test_a_view_crosses_with_its_strides_and_comes_back_the_same_view():
    import torch

    from attn_ledger.probes.common.driver import pack, unpack
    from attn_ledger.probes.module.driver import laid_flat, relaid

    qkv = torch.arange(2 * 3 * 12, dtype=torch.float32).reshape(2, 3, 12)
    views = {"q": qkv[..., :4], "kt": qkv[..., 4:8].transpose(-2, -1), "mask": torch.ones(3, 1, dtype=torch.bool).expand(3, 5),
             "plain": torch.randn(2, 3)}
    flat, layouts = laid_flat(views)
    back = relaid(unpack(pack(flat)), layouts)
    assert set(layouts) == {"q", "kt", "mask"}  # a plain tensor crosses as it is
    for name, t in views.items():
        assert torch.equal(back[name], t) and back[name].stride() == t.stride(), name


def test_an_observation_is_rebuilt_into_the_observation_classes_only():
    import torch

    from attn_ledger.probes.module.driver import flatten, rebuild
    from attn_ledger.probes.common.observe import Projection

    tensors: dict = {}
    out = torch.randn(2, 3, 4)
    data = flatten((Projection(0, "linear", out, "w"), {"same": out}), tensors)
    projection, extra = rebuild(data, tensors)
    assert isinstance(projection, Projection) and extra["same"] is projection.output  # one tensor, one object
    with pytest.raises(ValueError, match="not an observation"):
        rebuild({"__dataclass__": "Report", "fields": {}}, {})
