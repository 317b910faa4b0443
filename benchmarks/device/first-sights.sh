#!/usr/bin/env bash
# Issue 37's figures on the GPU machine in one call (about 6 minutes on a warm H200): the
# real-traffic first sights, one-question requests of 1,500 and 3,000 tokens, the same host steps
# without the device as on this project's CPU (`host_first_sight`: how fast this machine's host
# is, which real traffic's p50 follows: 1.80 ms of engine prepare on H200 B43, 4.02 on A48), and
# where a first sight's time goes (each host step timed in place, then the profile by kind; the
# bounds add to 605 s, over a call's 600: the profile may be cut); SETTINGS changes runtime
# settings for the first two (`bench.settings`, space-separated NAME=VALUE: scan.ALONE_FROM=none
# keeps one long sequence in 16-token steps). Each step is bounded; results land in $OUT, named after SUFFIX (by
# default, after SETTINGS).
# From the project root, with .gpusite and .whl carried (docs/design.md, "Running it on a GPU
# machine"):
#   bash benchmarks/device/first-sights.sh     # or SETTINGS="swiglu.BY_ROWS=1" SUFFIX=-rows bash ...
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
settings=${SETTINGS:+--settings $SETTINGS}
suffix=${SUFFIX:-${SETTINGS:+-$(echo "$SETTINGS" | tr ' .=' '__-')}}  # files apart from the default's
run 230 real-traffic$suffix real_traffic --count 80 $settings --out "$OUT/real$suffix.json"
run 110 long-context$suffix long_context --lengths 1500 3000 1490 2990 $settings --out "$OUT/long$suffix.json"
run 75 host host_first_sight --count 40 --rounds 2
run 90 steps real_traffic_steps --count 60
run 100 profile real_traffic_profile --count 40
stamp "done"
