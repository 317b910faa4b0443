#!/usr/bin/env bash
# Long sequences taken apart from the one-kernel walk (`scan.LONG_APART`, issue 36) on the GPU
# machine in one call (about 8 minutes on a warm H200; its bounds add to 530 s): its GPU tests,
# the scan's paths on a batch's unequal sequences (rows of the serving mix, prefixes of eight
# requests), then eight requests of the serving mix together, with the setting off and at 256
# and 512 tokens, each in a process of its own. Results in $OUT:
#   bash benchmarks/device/apart-ab.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
gpu_tests 90 apart tests/ops/test_kernels.py
run 110 prefixes delta_rule_prefixes --lengths 1024 --together 8 \
  --sets 1366,700,300,130,90,64,37 2000,1500,1200,900,700,400,300,200
for apart in none 256 512; do
  run 110 invocations-apart-$apart invocation_profile --batch 8 --groups 4 --top 20 --settings scan.LONG_APART=$apart
done
stamp "done"
