#!/usr/bin/env bash
# The launch settings of one long sequence's 64-token path (issue 37's one-question requests of
# 1,500 and 3,000 tokens), in one call on the GPU machine (about 2 minutes on a fresh machine):
# `delta_rule_prefixes`'s "64-token chunks" paths, the inverse's warps, the values and warps a
# program of W and U and of the outputs, the walk's stages and warps, each beside the runtime's
# (marked "taken"). Results in $OUT:
#   bash benchmarks/device/long-launches.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
run 200 long-launches delta_rule_prefixes --lengths 1500 3000 --together 1 --only "64-token chunks"
stamp "done"
