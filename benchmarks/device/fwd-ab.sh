#!/usr/bin/env bash
# The one-kernel walk's blocks of values and warps (`scan.FWD_VALUES`, `scan.FWD_WARPS`, issue 36)
# in the model on the GPU machine in one call (bounds add to 330 s): eight requests of the serving
# mix together with the default and two variants (FIRST and SECOND, by default
# `scan.FWD_VALUES=32` and `scan.FWD_WARPS=8`), each in a process of its own. The kernel alone,
# by every block and warps of the sweep: `rows-paths.sh`. Results in $OUT:
#   bash benchmarks/device/fwd-ab.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
for settings in "scan.FWD_VALUES=64" "${FIRST:-scan.FWD_VALUES=32}" "${SECOND:-scan.FWD_WARPS=8}"; do
  run 110 invocations-$(echo "$settings" | tr ' .=' '__-') invocation_profile --batch 8 --groups 4 --top 12 --settings $settings
done
stamp "done"
