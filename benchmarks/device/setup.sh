# Sourced at the start of a command on the GPU machine: unpack .gpusite and install .whl's wheels
# under /tmp (once a machine), then the environment; `stamp TEXT` appends a timed line to
# $OUT/timeline.txt; `gpu_tests` runs chosen tests (below); `run SECONDS NAME MEASUREMENT ARGS...` stamps NAME and runs the measurement
# for at most SECONDS, its report in $OUT/NAME.txt and its last lines on the call's output. Run
# state that must outlive a call goes under /tmp, never in the working tree: each call's copy of
# the tree removes what is not in it.
mkdir -p /tmp/gs /tmp/site
[ -d /tmp/gs/site ] || tar -xJf .gpusite/site.tar.xz -C /tmp/gs
[ -f /tmp/site/.done ] || { pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl && touch /tmp/site/.done; }
export PYTHONPATH=/tmp/gs/site:/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/gs/site/z3/lib:${LD_LIBRARY_PATH:-}
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
t0=${t0:-$(date +%s)}
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/timeline.txt"; }
# Python's own warnings (deprecations and the like) are dropped from the report; the runtime's
# (a failed capture and why: `WARNING:dohnuts...`) stay.
run() { local seconds=$1 name=$2; shift 2; stamp "$name"
  timeout "$seconds" python3 benchmarks/run.py "$@" 2>&1 | grep -v -E "Warning: |warnings.warn|warn_once" \
    | tee "$OUT/$name.txt" | tail -40; }
# `gpu_tests SECONDS FILTER FILE...`: the tests of FILE... whose names match FILTER (pytest -k),
# for at most SECONDS, their summary in $OUT/tests.txt.
gpu_tests() { local seconds=$1 filter=$2; shift 2; stamp "tests"
  timeout "$seconds" python3 -m pytest -q -p no:cacheprovider "$@" -k "$filter" 2>&1 | tail -5 | tee "$OUT/tests.txt"; }
# Rows like those of two groups of eight requests of the serving mix as `invocation_profile` met
# them (101 rows of 10,447 tokens, the longest 1,366; 120 of 8,531, the longest 272), the short
# ones made uniform, for `delta_rule_prefixes --sets`: 100 rows of 10,417 tokens and 120 of 8,483.
serving_rows_a=1366,700,300,$(printf '83,%.0s' $(seq 96))83
serving_rows_b=272,$(printf '69,%.0s' $(seq 118))69
# The rows of four real-traffic requests (`real_traffic --count 80`, seed 37: timed requests 48, 4,
# 41 and 19, from 0): 14 to 18 rows of 1,491 to 2,613 tokens, the longest 404 to 634, for
# `delta_rule_prefixes --sets`.
real_rows="510,192,148,116,107,107,106,100,80,73,73,73,73,73 404,244,193,164,155,146,140,140,138,128,103,94,94,94,94,94,94,94
634,494,365,104,86,70,67,59,59,59,34,34,34,34,34,34 545,150,86,86,77,68,68,59,59,50,41,34,34,34,34,34,32"
# The device tool brings back a few files only: pack $OUT into one archive before the command ends.
pack_out() { (cd "$OUT" && tar czf /tmp/out.tgz . && rm -rf ./* && mv /tmp/out.tgz .); }
