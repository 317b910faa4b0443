#!/usr/bin/env bash
# This tree's runtime against a base tree's on the GPU machine in one call (about 130 s a process
# on a warm H100; the first one on a fresh machine compiles Triton's kernels): `ab_mix.py` in a
# process of its own for each, in the order this, base (ORDER=base-first turns it round). Make the
# base first, here, from a revision (its dohnuts and benchmarks; xz keeps the carry under 64 MiB):
#   git archive REV dohnuts benchmarks | xz -9 > .gpusite/base.tar.xz
#   bash benchmarks/device/base-ab.sh
# With it, the carry (.gpusite and .whl) and the tree came to about 64 MiB, the device tool's
# limit: a wheel this command does not import (uvloop's, for the server) can wait outside .whl.
# Each process's "AB {...}" line lands in $OUT/ab.txt.
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xJf .gpusite/base.tar.xz -C /tmp/base
cp benchmarks/device/ab_mix.py /tmp/base/ab_mix.py
this() { stamp "this"; timeout 240 python3 benchmarks/device/ab_mix.py this 2>&1 | grep -E "^AB|Error" | tee -a "$OUT/ab.txt"; }
base() { stamp "base"; (cd /tmp/base && PYTHONPATH=/tmp/gs/site:/tmp/site:/tmp/base timeout 240 python3 ab_mix.py base 2>&1 \
  | grep -E "^AB|Error" | tee -a "$OUT/ab.txt"); }
if [ "${ORDER:-}" = base-first ]; then base; this; else this; base; fi
stamp "done"
