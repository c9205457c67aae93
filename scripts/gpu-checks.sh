#!/usr/bin/env bash
# The checks CI cannot run, for a machine with a CUDA device: the tests that skip without one
# (the CUDA IPC transport, prefill and decode workers on the GPU, the engine's parity with
# transformers there), the end-to-end tests of the mesh and `baton up` with every worker on the
# GPU (BATON_DEVICE=cuda), the mesh's overhead there (bench/mesh_overhead.py --device cuda: CUDA
# IPC against a device copy), a long prompt's pages sent while it computes
# (bench/early_kv_transfer.py --device cuda) and, with ENGINE_BENCH=1, the engine's throughput
# against transformers.generate on the GPU.
#
#   bash scripts/gpu-checks.sh [OUT_DIR]     (PYTHON=python3 by default; the repo's packages importable)
#
# One after another: each worker process takes a torch thread per core, and two groups side by
# side (or pytest-xdist) oversubscribed a 16-core machine until neither finished in 5 minutes.
# Logs go to OUT_DIR (default /tmp/gpu-checks); the exit status is the first failing group's. All of
# it may take 8 to 10 minutes on an H200 machine (by this session's runs of its parts); GPU_CHECKS
# names the parts to run (default "cuda-tests mesh-tests benches"), so two device calls can split them.
set -u
parts=" ${GPU_CHECKS:-cuda-tests mesh-tests benches} "
out=${1:-/tmp/gpu-checks}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."

$py -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' \
    2>&1 | tee "$out/device.log"
pytest_args=(-q -rfE -p no:cacheprovider)
$py -c 'import pytest_timeout' 2>/dev/null && pytest_args+=(--timeout 150)  # a hung test fails alone
status=0
if [[ $parts == *" cuda-tests "* ]]; then
    timeout 200 $py -m pytest "${pytest_args[@]}" \
        tests/unit/test_cuda_ipc.py tests/services/test_cuda_workers.py tests/services/test_worker_dtype.py \
        tests/services/kvstore/test_shared_memory.py tests/services/test_kv_pool_size.py \
        tests/parity/test_cuda_parity.py tests/parity/test_transformers_parity.py tests/unit/test_speculative.py \
        tests/unit/test_draft_model.py tests/unit/test_guided_decoding.py tests/services/prefill/test_early_pages.py \
        -k cuda 2>&1 | tee "$out/tests.log"
    status=${PIPESTATUS[0]}
fi
if [[ $parts == *" mesh-tests "* ]]; then
    BATON_DEVICE=cuda timeout 300 $py -m pytest "${pytest_args[@]}" \
        tests/services/gateway/test_openai_api.py tests/services/gateway/test_bad_input.py \
        tests/services/gateway/test_generate_grpc.py tests/services/gateway/test_cancel_api.py \
        tests/services/test_baton_up.py tests/services/test_colocated.py tests/services/prefill/test_early_pages.py \
        2>&1 | tee "$out/mesh-tests.log"
    [ "$status" -ne 0 ] || status=${PIPESTATUS[0]}
fi
if [[ $parts == *" benches "* ]]; then
    if [ "${ENGINE_BENCH:-0}" = 1 ]; then
        timeout 150 $py bench/engine_throughput.py --device cuda --models 7m,160m --quick --batch1-repeats 2 \
            2>&1 | tee "$out/bench.log"
    fi
    timeout 120 $py bench/mesh_overhead.py --device cuda --requests 30 2>&1 | tee "$out/mesh-overhead.log"
    timeout 120 $py bench/early_kv_transfer.py --device cuda --requests 8 2>&1 | tee "$out/early-kv.log"
fi
exit "$status"
