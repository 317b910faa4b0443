#!/usr/bin/env bash
# The delta rule walked in segments (issue 37's experiment, `ops.delta_rule.segments`) on the GPU
# machine in one call (about 6 minutes on a warm H200): its GPU tests, its time beside the scan's
# paths on long prefixes, then one-question requests of 1,500 and 3,000 tokens on first sight
# with the model's walk in 0, 4 and 8 runs, each in a process of its own. Results in $OUT:
#   bash benchmarks/device/segments-ab.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
export PYTHONUNBUFFERED=1
run() { local seconds=$1 name=$2; shift 2; stamp "$name"
  timeout "$seconds" python3 benchmarks/run.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt" | tail -40; }
stamp "tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kernels.py tests/runtime/test_cuda_graphs.py \
  -k "segment" 2>&1 | tail -5 | tee "$OUT/tests.txt"
run 120 delta-rule-segments delta_rule_prefixes --lengths 1408 2816 --together 1 2 --segments 2 4 8
for segments in 0 4 8; do
  run 100 long-context-$segments long_context --lengths 1500 3000 1490 2990 --segments $segments \
    --out "$OUT/long-$segments.json"
done
stamp "done"
