#!/usr/bin/env bash
# One long sequence walked in 64-token steps (`scan.ALONE_FROM`, issue 37) on the GPU machine in
# one call (about 7 minutes on a warm H200; its bounds add to 510 s): its GPU tests (no compile
# after load among them), the scan's paths on long prefixes alone and in pairs, then one-question
# requests of 1,500 and 3,000 tokens with the 64-token steps from 1,408 tokens (the default) and
# never (16-token steps), each in a process of its own. Results in $OUT:
#   bash benchmarks/device/alone-ab.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
gpu_tests 200 "one_long or bucket_graphs_serve or no_request_compiles" tests/ops/test_kernels.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_engine.py
run 110 prefixes delta_rule_prefixes --lengths 1408 2816 --together 1 2
for from in 1408 none; do
  run 100 long-alone-$from long_context --lengths 1500 3000 1490 2990 1510 3010 1480 2980 \
    --settings scan.ALONE_FROM=$from --out "$OUT/long-alone-$from.json"
done
stamp "done"
