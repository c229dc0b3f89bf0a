"""The GitHub Actions workflow of docs/ci.md, run here: its ``run:`` steps on a small project, and the JUnit it writes.

The workflow and the test file it runs are read from the page (the blocks marked
``<!-- file: PATH -->``). The install step is left out: the package is installed here
already. Steps run in order with bash, as GitHub runs them (``if: failure()`` only after a
failed step, ``if: always()`` regardless, otherwise only while nothing has failed), on a
broken kernel, so that every step runs and the JUnit files hold failures.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from attn_ledger.probes.kernel.cases import tier_cases

yaml = pytest.importorskip("yaml", reason="PyYAML (in the dev extra: pip install -e '.[dev]')") \
    if not os.environ.get("CI") else __import__("yaml")

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ci.md"


def page_files() -> dict[str, str]:
    """The files the page spells out, by the path in their ``<!-- file: PATH -->`` marker."""
    found = {}
    for path, body in re.findall(r"(?ms)^<!-- file: (\S+) -->\n```\w*\n(.*?)^```", PAGE.read_text()):
        found[path] = body
    return found


def workflow() -> dict:
    return yaml.safe_load(page_files()[".github/workflows/attention.yml"])


def _project(tmp: Path, kernel: str) -> Path:
    (tmp / "mypkg").mkdir()
    (tmp / "mypkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / "fixtures" / "kernels" / kernel, tmp / "mypkg" / "attention.py")
    for path, text in page_files().items():
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp / path).write_text(text)
    return tmp


def _run_steps(project: Path) -> list[tuple[str, int | None, str]]:
    """Run the job's steps as GitHub would; (step name, exit status or None when skipped, stdout) each."""
    (job,) = workflow()["jobs"].values()
    env = {**os.environ, **{k: str(v) for k, v in job.get("env", {}).items()},
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("COLUMNS", None)
    failed = False
    ran = []
    for step in job["steps"]:
        name = step.get("name", step.get("uses", ""))
        if "run" not in step or "pip install" in step["run"]:  # actions and the install step: not offline
            ran.append((name, None, ""))
            continue
        condition = step.get("if", "success()")
        if not {"always()": True, "failure()": failed, "success()": not failed}[condition]:
            ran.append((name, None, ""))
            continue
        proc = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=project, env=env,
                              capture_output=True, text=True, timeout=600)
        ran.append((name, proc.returncode, proc.stdout))
        if proc.returncode not in (0, 1):
            pytest.fail(f"step {name!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        failed = failed or proc.returncode != 0
    return ran


def junit_counts(path: Path) -> tuple[int, int, int]:
    """(tests, failures, test cases) of a JUnit file, checking that the attributes match the cases."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failures = cases = 0
    for suite in suites:
        found = suite.findall("testcase")
        failed = [c for c in found if c.find("failure") is not None or c.find("error") is not None]
        assert int(suite.get("tests")) == len(found), (path, suite.get("name"))
        assert int(suite.get("failures", 0)) + int(suite.get("errors", 0)) == len(failed), (path, suite.get("name"))
        tests, failures, cases = tests + len(found), failures + len(failed), cases + len(found)
    if root.tag == "testsuites" and root.get("tests") is not None:
        assert int(root.get("tests")) == tests and int(root.get("failures")) + int(root.get("errors", 0)) == failures
    return tests, failures, cases


def test_the_workflow_is_valid_and_names_the_formats():
    flow = workflow()
    (job,) = flow["jobs"].values()
    runs = " ".join(s.get("run", "") for s in job["steps"])
    assert "--format junit" in runs and "--format github" in runs and "pytest" in runs
    assert any(s.get("run", "").count("pip install") for s in job["steps"])  # the step left out here
    assert "tests/test_attention.py" in page_files()


def test_workflow_on_a_broken_kernel(tmp_path):
    project = _project(tmp_path, "sdpa_is_causal.py")
    ran = _run_steps(project)
    assert [v for _, v, _ in ran if v is not None] == [1, 1, 1]  # check, annotations (after the failure), pytest
    annotations = next(out for name, _, out in ran if "Annotate" in name)
    assert annotations.startswith("::error ") and "reference" in annotations
    tests, failures, _ = junit_counts(project / "reports" / "attn-ledger-check.xml")
    assert tests == len(tier_cases("default")) and failures > 0  # one test case per case of the default tier
    root = ET.parse(project / "reports" / "attn-ledger-check.xml").getroot()
    messages = [f.get("message", "") for f in root.iter("failure")]
    assert any("reference" in m for m in messages) and all(m for m in messages)
    assert junit_counts(project / "reports" / "pytest.xml")[:2] == (2, 2)  # both tests of the page's test file


def test_junit_counts_catch_attributes_that_disagree_with_the_cases(tmp_path):
    good = tmp_path / "good.xml"
    good.write_text('<testsuite name="s" tests="2" failures="1"><testcase name="a"/>'
                    '<testcase name="b"><failure message="m"/></testcase></testsuite>')
    assert junit_counts(good) == (2, 1, 2)
    bad = tmp_path / "bad.xml"
    bad.write_text('<testsuite name="s" tests="3" failures="0"><testcase name="a"/></testsuite>')
    with pytest.raises(AssertionError):
        junit_counts(bad)
