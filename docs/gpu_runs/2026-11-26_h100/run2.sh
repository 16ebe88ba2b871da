#!/bin/bash
# session 14, second GPU call: why normal mode fails on >= 2 ranks (hypothesis: cudaMalloc
# while a peer's kernel spins), with tracebacks; then timing and memcheck
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 MOE_COMM_TEST_TIMEOUT_S=10
export PYTHONUNBUFFERED=1 MOE_COMM_CACHE_DIR=/tmp/kc
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el build; timeout 40 python3 bench/gpu_check.py --step build > $OUT/build.log 2>&1; el "rc $?"
P="python3 -m pytest -q --tb=short -rfE -p no:cacheprovider --timeout=45"
el nofix; timeout 55 $P "tests/test_cuda_gpu.py::test_normal_dispatch_combine_match_reference[2]" > $OUT/a_nofix.log 2>&1; el "rc $?"
export PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
el fix; timeout 100 $P "tests/test_cuda_gpu.py::test_normal_dispatch_combine_match_reference" "tests/test_cuda_gpu.py::test_low_latency_matches_reference[16]" > $OUT/b_fix.log 2>&1; el "rc $?"
el timing; timeout 75 python3 bench/gpu_check.py --step timing --iters 10 --comm-timeout 10 > $OUT/timing.log 2>&1; el "rc $?"
el memcheck; CUDA_MODULE_LOADING=LAZY timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 --print-limit 30 python3 bench/gpu_check.py --step small-case > $OUT/memcheck.log 2>&1; el "rc $?"
tail -5 $OUT/a_nofix.log; tail -8 $OUT/b_fix.log; grep -h "@gpu_check" $OUT/timing.log | cut -c1-300; tail -5 $OUT/memcheck.log
