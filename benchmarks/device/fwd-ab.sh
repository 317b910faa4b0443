#!/usr/bin/env bash
# The one-kernel walk's blocks of values and warps (`scan.FWD_VALUES`, `scan.FWD_WARPS`, issue 36)
# on the GPU machine in one call (bounds add to 480 s): the scan alone on eight 1,024-token
# prefixes and on rows like two groups' of eight serving-mix requests (`serving_rows_a` and
# `_b`, setup.sh), every one-kernel path of the sweep; then eight requests together in the model
# with the default and two variants (FIRST and SECOND, by default `scan.FWD_VALUES=32` and
# `scan.FWD_WARPS=8`), each in a process of its own. Results in $OUT:
#   bash benchmarks/device/fwd-ab.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
run 150 fwd-sweep delta_rule_prefixes --lengths 1024 --together 8 --sets "$serving_rows_a" "$serving_rows_b" \
  --only "one kernel"
for settings in "scan.FWD_VALUES=64" "${FIRST:-scan.FWD_VALUES=32}" "${SECOND:-scan.FWD_WARPS=8}"; do
  run 110 invocations-$(echo "$settings" | tr ' .=' '__-') invocation_profile --batch 8 --groups 4 --top 12 --settings $settings
done
stamp "done"
