#!/usr/bin/env bash
# The CUDA path checked against the CPU: every job on zoo models, then the tests marked `gpu`.
# Without CUDA it prints what it would run and exits 0. Under 8 minutes on one GPU when the zoo
# models are cached (train them on the CPU first: `hf-rebasin zoo gpt2 0 1`, `hf-rebasin zoo gpt2-ft 0`,
# and carry $HF_REBASIN_CACHE); pass --bench for the learned benchmark on a bench-gpt2 pair too.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"  # the GPU images name only python3
status=0
timeout 480 "$PYTHON" benchmarks/scale/gpu_check.py "$@" || status=$?  # the tests below run either way
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    "$PYTHON" -m pytest -q -m gpu tests || status=$?
else
    echo "gpu_check: tests marked gpu skipped (no CUDA)"
fi
exit "$status"
