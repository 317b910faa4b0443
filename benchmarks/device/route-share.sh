#!/usr/bin/env bash
# `scan.ROUTE_SHARE` on trial (issue 37's real traffic), in one call on the GPU machine (bounds add
# to 500 s): the delta rule's paths on the rows of four real-traffic requests (`real_rows`,
# setup.sh; at ROUTE_SHARE=4 the route would send three of them, whose longest row holds 28 to 50%
# of their long rows' tokens, to the parts then the 16-token walk, and keep the second, 15%, on the
# one-kernel walk): the parts then the walk against the one-kernel walk and its variants of values
# and warps; then `real_traffic` (60 requests) with SETTING (by default scan.ROUTE_SHARE=4) and
# with BASE (by default scan.ROUTE_SHARE=none), one setting each, each in a process of its own,
# the setting's first: run it again with ORDER=base for the other order (trials.sh says why the
# order matters). Results in $OUT:
#   bash benchmarks/device/route-share.sh      # or SETTING=... BASE=... ORDER=base
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
# shellcheck disable=SC2086  # real_rows is several sets
run 100 route-rows delta_rule_prefixes --lengths 64 --together 1 --sets $real_rows \
  --only "parts 1 a program, walk values 32, stages None, warps 4" "one kernel"
setting=${SETTING:-scan.ROUTE_SHARE=4}
base=${BASE:-scan.ROUTE_SHARE=none}
first=$setting second=$base
[ "${ORDER:-setting}" = base ] && first=$base second=$setting
for settings in "$first" "$second"; do
  name=real-$(echo "$settings" | tr '.=' '_-')
  run 200 "$name" real_traffic --count 60 --settings "$settings" --out "$OUT/$name.json"
done
stamp "done"
