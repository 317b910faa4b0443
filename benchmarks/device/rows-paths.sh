#!/usr/bin/env bash
# The delta rule's paths on a batch's many short rows (issue 36), on the GPU machine in one call
# (about 4 minutes on a fresh machine): the rows of two groups of eight requests of the serving
# mix (as `fwd-ab.sh`) by the parts then the 16-token walk, the 64-token chunks solved whole then
# walked, and the one-kernel walk the runtime takes there. Results in $OUT:
#   bash benchmarks/device/rows-paths.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
rows_a=1366,700,300,$(printf '83,%.0s' $(seq 96))83
rows_b=272,$(printf '69,%.0s' $(seq 118))69
short=$(printf '69,%.0s' $(seq 119))69
run 280 rows-paths delta_rule_prefixes --lengths 1024 --together 8 --sets "$rows_a" "$rows_b" "$short" \
  --only "parts 1 a program, walk values 32, stages None, warps 4" "64-token chunks solved whole" "one kernel"
stamp "done"
