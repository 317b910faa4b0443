#!/usr/bin/env bash
# Issue 36's serving lines on the GPU machine in one call (about 8 minutes on a warm H200; its
# bound is 500 s): `dohnuts serve` in its own processes (8 front ends, one engine) under the load
# harness's client processes, open loop at each of RATES requests/s of the serving mix (the last
# at or past twice the highest held under p99 500 ms in the last soak, 150: the overload line),
# then closed loop at each of CLIENTS, SECONDS_A_LEVEL a level after 5 s of warm-up; the record (offered
# against achieved, p50/p95/p99, decisions/s, 429s, errors, eager share, GPU busy) in
# $OUT/serving.json, kept level by level. From the project root, .gpusite and .whl carried:
#   bash benchmarks/device/serving.sh     # or RATES="100 200" CLIENTS="1 64" SECONDS_A_LEVEL=30 bash ...
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
stamp "serving"
timeout 500 python3 benchmarks/run.py serving_workload --requests 4096 --rates ${RATES:-100 150 300} \
  --clients ${CLIENTS:-1 8 64 256} --seconds ${SECONDS_A_LEVEL:-30} --workers 8 --processes 4 --client-cpus 4 \
  --out "$OUT/serving.json" 2>&1 > /dev/null | tee "$OUT/serving-levels.txt"
stamp "done"
