#!/usr/bin/env bash
# `scan.ROUTE_SHARE` on trial (issue 37's real traffic), in one call on the GPU machine (bounds add
# to 550 s): the delta rule's paths on the rows of four real-traffic requests whose longest row
# holds most of their tokens (`real_rows`, setup.sh: the parts then the 16-token walk against the
# one-kernel walk the count of rows picks now), then `real_traffic` (60 requests) with
# SETTING (by default scan.ROUTE_SHARE=4) and with BASE (by default scan.ROUTE_SHARE=none), each in
# a process of its own, the setting's first: run it again with ORDER=base for the other order
# (trials.sh says why the order matters). Results in $OUT:
#   bash benchmarks/device/route-share.sh      # or SETTING=... BASE=... ORDER=base
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
# shellcheck disable=SC2086  # real_rows is several sets
run 150 route-rows delta_rule_prefixes --lengths 64 --together 1 --sets $real_rows \
  --only "parts 1 a program, walk values 32, stages None, warps 4" "one kernel"
setting=${SETTING:-scan.ROUTE_SHARE=4}
base=${BASE:-scan.ROUTE_SHARE=none}
order="$setting $base"
[ "${ORDER:-setting}" = base ] && order="$base $setting"
for settings in $order; do
  run 200 "real-$(echo "$settings" | tr '.=' '_-')" real_traffic --count 60 --settings "$settings" \
    --out "$OUT/real-$(echo "$settings" | tr '.=' '_-').json"
done
stamp "done"
