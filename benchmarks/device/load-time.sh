#!/usr/bin/env bash
# Issue 37's load time, cold and warm, and the one-warm-up trial, in one call (about 7 minutes on
# an H200): the shape-only 0.8B deployable written once under /tmp, then two engine loads with
# the default settings (the first with Triton's kernel cache empty) and two with
# graphs.WARM_UPS=1 (a bucket's capture after one eager forward instead of two). Results land in
# $OUT. From the project root, with .gpusite and .whl carried (docs/design.md, "Running it on a
# GPU machine"):
#   bash benchmarks/device/load-time.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
stamp "checkpoint"
[ -d /tmp/shape-0.8b ] || python3 -c "from pathlib import Path; from dohnuts.bench.shapes import \
write_shape_checkpoint; write_shape_checkpoint('qwen3_5-0.8b', Path('/tmp/shape-0.8b'))"
run 270 load-time load_time --runs 2 --checkpoint /tmp/shape-0.8b --out "$OUT/load.json"
run 240 load-time-warm-ups-1 load_time --runs 2 --checkpoint /tmp/shape-0.8b --settings graphs.WARM_UPS=1 \
  --out "$OUT/load-warm-ups-1.json"
stamp "done"
