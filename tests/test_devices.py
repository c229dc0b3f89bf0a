"""attn_ledger.devices: the device and dtype helpers, in the base floor and torch-free at import."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_ledger import devices
from attn_ledger.errors import InputError


def test_devices_imports_only_the_base_and_no_torch():
    tree = ast.parse(Path(devices.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    ours = {n.module for n in top if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("attn_ledger")}
    assert ours == {"attn_ledger.errors"}
    code = "import sys, attn_ledger.devices; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_names_become_dtypes_and_references():
    assert [devices.torch_dtype(n) for n in ("float32", "float64", "float16", "bfloat16")] == [
        torch.float32, torch.float64, torch.float16, torch.bfloat16]
    assert devices.reference_dtype(torch.device("cpu")) is torch.float64
    assert devices.reference_dtype(torch.device("mps")) is torch.float32  # MPS has no float64
    assert devices.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_an_absent_device_is_an_input_error():
    with pytest.raises(InputError, match=r"^device: got 'cuda:1', but CUDA is not available here; expected cpu or auto$"):
        devices.resolve_device("cuda:1")
    if not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        assert devices.resolve_device("auto") == torch.device("cpu")
