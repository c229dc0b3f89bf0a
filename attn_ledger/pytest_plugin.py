"""A pytest plugin that only records pytest's rootdir, so that :mod:`attn_ledger.testing` reads the
``[tool.attn-ledger.check]`` table of the project under test. Registered through the ``pytest11``
entry point; it imports nothing heavy."""

from __future__ import annotations

from typing import Any

ROOTDIR: Any = None


def pytest_configure(config: Any) -> None:
    global ROOTDIR
    ROOTDIR = config.rootpath


def pytest_unconfigure(config: Any) -> None:
    global ROOTDIR
    ROOTDIR = None
