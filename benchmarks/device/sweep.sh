#!/usr/bin/env bash
# SwiGLU by rows and the elementwise kernels' launch settings on the GPU machine in one call
# (about 6 minutes on a warm H200; its bounds add to 390 s): their GPU tests; the convolution and
# SwiGLU kernels of one long row by launch setting (`elementwise_sweep`); then one-question
# requests of 1,500 and 3,000 tokens with SwiGLU's programs by rows (`swiglu.BY_ROWS`) off and
# on, each in a process of its own. Real traffic with a setting: `first-sights.sh` with SETTINGS,
# beside a run without on the same machine. Results in $OUT:
#   bash benchmarks/device/sweep.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
gpu_tests 90 swiglu tests/ops/test_kernels.py
run 80 elementwise elementwise_sweep --lengths 1500 3000
for rows in 0 1; do
  run 110 long-rows-$rows long_context --lengths 1500 3000 1490 2990 --settings swiglu.BY_ROWS=$rows \
    --out "$OUT/long-rows-$rows.json"
done
stamp "done"
