#!/usr/bin/env bash
# The delta rule's paths on a batch's many short rows (issue 36), on the GPU machine in one call
# (about 4 minutes on a fresh machine): eight 1,024-token prefixes, rows like two groups' of
# eight serving-mix requests (`serving_rows_a` and `_b`, setup.sh) and 120 rows of 69 tokens, by
# the parts then the 16-token walk (32 values, 4 warps), the 64-token chunks solved whole then
# walked (the sweep's four variants) and the one-kernel walk the runtime takes there (the sweep's
# six blocks of values and warps). Results in $OUT:
#   bash benchmarks/device/rows-paths.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
short=$(printf '69,%.0s' $(seq 119))69
run 280 rows-paths delta_rule_prefixes --lengths 1024 --together 8 --sets "$serving_rows_a" "$serving_rows_b" "$short" \
  --only "parts 1 a program, walk values 32, stages None, warps 4" "64-token chunks solved whole" "one kernel"
stamp "done"
