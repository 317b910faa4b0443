#!/usr/bin/env bash
# A setting on trial judged in one call on the GPU machine (bounds add to 450 s; TESTS=1 runs GPU
# tests instead: the scan's, SwiGLU's, the one-row bucket's attention's, no compile on a request):
# one-question requests of 1,500 and 3,000 tokens (`long_row_profile`: their bucket graph's device
# span replayed alone, its kernels, and first sights of new texts) with SETTING (by default
# swiglu.BY_ROWS=1, on trial), with BASE (by default SETTING's name =0: give it for a setting that
# is not a flag, or several), then with SETTING again, each in a process of its own: the two are
# timed on one machine, and the repeat shows what the order alone moves (session 38's one A/B found
# attention.DENSE_LONE's process, run first, 0.6-1.9 ms slower with a kernel twice as fast; session
# 39's on, off, on found it 0.3-0.6 ms faster both times, and it is now on by default). On a fresh
# machine the first run compiles its kernels (Triton's cache is empty), which takes most of a
# minute: hence 150 s a run.
# Results in $OUT:
#   bash benchmarks/device/trials.sh      # or SETTING=... BASE=..., or TESTS=1
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
if [ "${TESTS:-0}" = 1 ]; then
  gpu_tests 300 "swiglu or delta_rule_scan or one_long or past_the_gradient or bucket_graphs_serve or lone_rows or \
no_request_compiles" tests/ops/test_kernels.py tests/runtime/test_cuda_graphs.py tests/runtime/test_engine.py
  stamp "done"
  exit
fi
setting=${SETTING:-swiglu.BY_ROWS=1}
base=${BASE:-${setting%%=*}=0}
for settings in "$setting" "$base" "$setting"; do
  name=long-row-$(echo "$settings" | tr ' .=' '__-')
  [ -e "$OUT/$name.txt" ] && name=$name-again
  run 150 "$name" long_row_profile --lengths 1500 3000 --top 12 --firsts 8 --settings $settings
done
stamp "done"
