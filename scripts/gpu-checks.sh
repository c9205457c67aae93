#!/usr/bin/env bash
# The checks CI cannot run, for a machine with a CUDA device: the tests that skip without one
# (the CUDA IPC transport, prefill and decode workers on the GPU, the engine's parity with
# transformers there), the end-to-end tests of the mesh with every worker on the GPU
# (BATON_DEVICE=cuda), the engine's throughput against transformers.generate on the GPU, and the
# mesh's overhead there (bench/mesh_overhead.py --device cuda: CUDA IPC against a device copy).
#
#   bash scripts/gpu-checks.sh [OUT_DIR]     (PYTHON=python3 by default; the repo's packages importable)
#
# Logs go to OUT_DIR (default /tmp/gpu-checks); the exit status is the first failing tests'.
set -u
out=${1:-/tmp/gpu-checks}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."

$py -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' \
    2>&1 | tee "$out/device.log"
per_test=()  # a hung test fails alone where pytest-timeout is installed
$py -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 150)
timeout 240 $py -m pytest -v -p no:cacheprovider "${per_test[@]}" \
    tests/unit/test_cuda_ipc.py tests/services/test_cuda_workers.py tests/services/test_worker_dtype.py \
    tests/parity/test_cuda_parity.py tests/parity/test_transformers_parity.py tests/unit/test_speculative.py \
    tests/unit/test_draft_model.py tests/unit/test_guided_decoding.py -k cuda 2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}
BATON_DEVICE=cuda timeout 240 $py -m pytest -v -p no:cacheprovider "${per_test[@]}" \
    tests/services/gateway/test_openai_api.py tests/services/gateway/test_bad_input.py \
    tests/services/gateway/test_generate_grpc.py tests/services/gateway/test_cancel_api.py \
    2>&1 | tee "$out/mesh-tests.log"
[ "$status" -ne 0 ] || status=${PIPESTATUS[0]}
timeout 150 $py bench/engine_throughput.py --device cuda --models 7m,160m --quick --batch1-repeats 2 \
    2>&1 | tee "$out/bench.log"
timeout 200 $py bench/mesh_overhead.py --device cuda --requests 30 2>&1 | tee "$out/mesh-overhead.log"
exit "$status"
