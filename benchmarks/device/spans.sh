#!/usr/bin/env bash
# One long sequence's walk in spans (`scan.ALONE_SPAN`, issue 37's 3,000-token line) and the
# kernels not yet run on a GPU, in one call on the GPU machine (bounds add to 560 s): the GPU
# tests of the walk in spans, of the attention's gate kernel (`kernels.gated`), of the vision
# tower's split and rotation (`kernels.split_rotate`), of the bucket graphs (every bucket
# captures) and of no compile on a request after load; then `delta_rule_prefixes`' one-long
# paths at 1,500 and 3,000 tokens (the walk in one pass, and in spans of 4 to 12 chunks with 16
# to 64 values a program); then one-question requests of 1,500 and 3,000 tokens on first sight,
# the default, then with spans of SPAN chunks (8 unless given) and VALUES values a program (16
# unless given) in a process of its own. Results in $OUT:
#   bash benchmarks/device/spans.sh        # or SPAN=6 VALUES=32 bash benchmarks/device/spans.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
span=${SPAN:-8} values=${VALUES:-16}
gpu_tests 200 "one_long or packed_projection or split_rotate or no_request_compiles or vision or bucket" -m gpu \
  tests/ops/test_kernels.py tests/runtime/test_engine.py tests/model/test_vision.py tests/runtime/test_vision_graphs.py \
  tests/runtime/test_cuda_graphs.py
run 100 spans delta_rule_prefixes --lengths 1500 3000 --together 1 --only "one long"
run 130 long-context long_context --lengths 1500 3000 1490 2990 --out "$OUT/long.json"
run 130 long-context-span long_context --lengths 1500 3000 1490 2990 \
  --settings scan.ALONE_SPAN=$span scan.SPAN_VALUES=$values --out "$OUT/long-span-$span-$values.json"
stamp "done"
