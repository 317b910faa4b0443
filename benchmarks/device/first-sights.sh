#!/usr/bin/env bash
# Issue 37's figures on the GPU machine in one call (about 6 minutes on a warm H200): the
# real-traffic first sights, one-question requests of 1,500 and 3,000 tokens, where a first sight's
# time goes (the profile), the delta rule's paths on long prefixes with the walk in segments, and
# the GPU tests of the scan. Each step is bounded; results land in $OUT (run from the project
# root with .gpusite and .whl carried, docs/design.md "Running it on a GPU machine"):
#   bash benchmarks/device/first-sights.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
export PYTHONUNBUFFERED=1
run() { local seconds=$1 name=$2; shift 2; stamp "$name"
  timeout "$seconds" python3 benchmarks/run.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt" | tail -40; }
run 230 real-traffic real_traffic --count 80 --out "$OUT/real.json"
run 110 long-context long_context --lengths 1500 3000 1490 2990 --out "$OUT/long.json"
run 150 delta-rule-segments delta_rule_prefixes --lengths 1408 2816 --together 1 2 --segments 2 4 8
stamp "tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kernels.py -k "scan or segmented" 2>&1 | tail -5 | tee "$OUT/tests.txt"
run 100 profile real_traffic_profile --count 40
stamp "done"
