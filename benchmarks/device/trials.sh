#!/usr/bin/env bash
# The three settings on trial (session 35) judged in one call on the GPU machine (bounds add to
# 560 s): the GPU tests of each (the one-product walk, long sequences apart, SwiGLU by rows, no
# compile after load), then one-question requests of 1,500 and 3,000 tokens with the default
# settings, `scan.STEP_PRODUCTS=1`, `swiglu.BY_ROWS=1` and both, each in a process of its own, so
# the four are timed on one machine. Results in $OUT:
#   bash benchmarks/device/trials.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
gpu_tests 240 "one_long or bucket_graphs_serve or no_request_compiles or apart or swiglu" \
  tests/ops/test_kernels.py tests/runtime/test_cuda_graphs.py tests/runtime/test_engine.py
lengths="1500 3000 1490 2990 1510 3010"
for settings in "scan.STEP_PRODUCTS=2" "scan.STEP_PRODUCTS=1" "swiglu.BY_ROWS=1" \
    "scan.STEP_PRODUCTS=1 swiglu.BY_ROWS=1"; do
  name=long-$(echo "$settings" | tr ' .=' '__-')
  run 80 "$name" long_context --lengths $lengths --settings $settings --out "$OUT/$name.json"
done
stamp "done"
