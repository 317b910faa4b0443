#!/usr/bin/env bash
# The setting on trial (`swiglu.BY_ROWS`) judged in one call on the GPU machine (bounds add to
# 280 s; TESTS=1 runs GPU tests instead, its own and the delta-rule scan's): one-question requests of 1,500 and 3,000 tokens with
# the default settings and with `swiglu.BY_ROWS=1`, each in a process of its own, so the two are
# timed on one machine. On a fresh machine the first run compiles its kernels (Triton's cache is
# empty), which takes most of a minute: hence 140 s a run.
# Results in $OUT:
#   bash benchmarks/device/trials.sh      # or TESTS=1 bash benchmarks/device/trials.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
if [ "${TESTS:-0}" = 1 ]; then
  gpu_tests 300 "swiglu or delta_rule_scan or one_long or past_the_gradient or bucket_graphs_serve" \
    tests/ops/test_kernels.py tests/runtime/test_cuda_graphs.py
  stamp "done"
  exit
fi
lengths="1500 3000 1490 2990 1510 3010"
for settings in "swiglu.BY_ROWS=1" "swiglu.BY_ROWS=0"; do  # the setting first: its one timing ran it second
  name=long-$(echo "$settings" | tr ' .=' '__-')
  run 140 "$name" long_context --lengths $lengths --settings $settings --out "$OUT/$name.json"
done
stamp "done"
