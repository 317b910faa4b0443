#!/usr/bin/env bash
# Settings not yet on by default, on the GPU machine in one call (about 8 minutes on a warm H200;
# its bounds add to 560 s): their GPU tests; the convolution and SwiGLU kernels of one long row by
# launch setting (`elementwise_sweep`); then one-question requests of 1,500 and 3,000 tokens and
# the real-traffic first sights with SwiGLU's programs by rows (`swiglu.BY_ROWS`) and without,
# each in a process of its own. Results in $OUT:
#   bash benchmarks/device/sweep.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
export PYTHONUNBUFFERED=1
run() { local seconds=$1 name=$2; shift 2; stamp "$name"
  timeout "$seconds" python3 benchmarks/run.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt" | tail -40; }
stamp "tests"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kernels.py -k "swiglu or one_long" 2>&1 \
  | tail -5 | tee "$OUT/tests.txt"
run 80 elementwise elementwise_sweep --lengths 1500 3000
for rows in 0 1; do
  run 90 long-rows-$rows long_context --lengths 1500 3000 1490 2990 --settings swiglu.BY_ROWS=$rows \
    --out "$OUT/long-rows-$rows.json"
done
run 200 real-rows-1 real_traffic --count 80 --settings swiglu.BY_ROWS=1 --out "$OUT/real-rows-1.json"
stamp "done"
