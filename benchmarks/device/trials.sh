#!/usr/bin/env bash
# The three settings on trial (session 35) judged in one call on the GPU machine (bounds add to
# 520 s; TESTS=1 runs their GPU tests instead, about 200 s, passed on an H100 at 919d2a2): one-question
# requests of 1,500 and 3,000 tokens with the default settings, `scan.STEP_PRODUCTS=1`,
# `swiglu.BY_ROWS=1` and both, each in a process of its own, so the four are timed on one
# machine. On a fresh machine the first runs compile their kernels (Triton's cache is empty):
# at 80 s a run, the first three of session 36's call were stopped before they printed.
# Results in $OUT:
#   bash benchmarks/device/trials.sh      # or TESTS=1 bash benchmarks/device/trials.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
if [ "${TESTS:-0}" = 1 ]; then
  gpu_tests 240 "one_long or bucket_graphs_serve or no_request_compiles or apart or swiglu" \
    tests/ops/test_kernels.py tests/runtime/test_cuda_graphs.py tests/runtime/test_engine.py
  stamp "done"
  exit
fi
lengths="1500 3000 1490 2990 1510 3010"
for settings in "scan.STEP_PRODUCTS=2" "scan.STEP_PRODUCTS=1" "swiglu.BY_ROWS=1" \
    "scan.STEP_PRODUCTS=1 swiglu.BY_ROWS=1"; do
  name=long-$(echo "$settings" | tr ' .=' '__-')
  bound=140; [ "$name" = long-scan_STEP_PRODUCTS-1_swiglu_BY_ROWS-1 ] && bound=100  # its kernels are built by then
  run $bound "$name" long_context --lengths $lengths --settings $settings --out "$OUT/$name.json"
done
stamp "done"
