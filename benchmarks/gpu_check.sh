#!/usr/bin/env bash
# GPU check for attn-ledger: the CUDA tests, then the ledger/SDPA benchmark on CUDA shapes.
# Run from the repository root on a machine with CUDA (about 2-4 minutes):
#   bash benchmarks/gpu_check.sh
# Output goes to stdout; with OUT set (a directory), a copy of each part is written there too.
set -uo pipefail
out="${OUT:-}"
log() { if [ -n "$out" ]; then tee -a "$out/$1"; else cat; fi; }

python - <<'PY' | log gpu_env.txt
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name())
PY

timeout 240 python -m pytest -q -rs tests/test_gpu.py tests/test_backends.py tests/test_half.py 2>&1 | log gpu_tests.txt
echo "pytest exit: ${PIPESTATUS[0]}" | log gpu_tests.txt

# ratio shapes and a short scaling table on CUDA (host RSS columns are not GPU memory)
timeout 240 python benchmarks/bench_ledger.py --device cuda --repeats 5 --max-t 8192 2>&1 | log gpu_bench.md
echo "bench exit: ${PIPESTATUS[0]}" | log gpu_bench.md
