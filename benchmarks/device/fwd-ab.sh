#!/usr/bin/env bash
# The one-kernel walk's blocks of values and warps (`scan.FWD_VALUES`, `scan.FWD_WARPS`, issue 36)
# on the GPU machine in one call (bounds add to 480 s): the scan alone on eight 1,024-token
# prefixes and on the rows of two groups of eight requests of the serving mix (their lengths as
# `invocation_profile` met them: 101 rows of 10,447 tokens, the longest 1,366; 120 of 8,531, the
# longest 272), then eight requests together in the model with the default and two variants, each
# in a process of its own. Results in $OUT:
#   bash benchmarks/device/fwd-ab.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
rows_a=1366,700,300,$(printf '83,%.0s' $(seq 96))83
rows_b=272,$(printf '69,%.0s' $(seq 118))69
run 150 fwd-sweep delta_rule_prefixes --lengths 1024 --together 8 --sets "$rows_a" "$rows_b" --only "one kernel"
for settings in "scan.FWD_VALUES=64" "${FIRST:-scan.FWD_VALUES=32}" "${SECOND:-scan.FWD_WARPS=8}"; do
  run 110 invocations-$(echo "$settings" | tr ' .=' '__-') invocation_profile --batch 8 --groups 4 --top 12 --settings $settings
done
stamp "done"
