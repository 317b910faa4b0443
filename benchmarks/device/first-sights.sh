#!/usr/bin/env bash
# Issue 37's figures on the GPU machine in one call (about 5 minutes on a warm H200): the
# real-traffic first sights, one-question requests of 1,500 and 3,000 tokens, and where a first
# sight's time goes (the profile), the delta rule walked in SEGMENTS runs where it applies
# (default 0: off). Each step is bounded; results land in $OUT. From the project root, with
# .gpusite and .whl carried (docs/design.md, "Running it on a GPU machine"):
#   bash benchmarks/device/first-sights.sh            # or SEGMENTS=4 bash ...
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
export PYTHONUNBUFFERED=1
segments=${SEGMENTS:-0}
run() { local seconds=$1 name=$2; shift 2; stamp "$name"
  timeout "$seconds" python3 benchmarks/run.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt" | tail -40; }
run 230 real-traffic-$segments real_traffic --count 80 --segments "$segments" --out "$OUT/real-$segments.json"
run 110 long-context-$segments long_context --lengths 1500 3000 1490 2990 --segments "$segments" \
  --out "$OUT/long-$segments.json"
run 100 profile real_traffic_profile --count 40
stamp "done"
