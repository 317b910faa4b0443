#!/usr/bin/env bash
# The serving soak on the GPU machine (issue 38): open loop at RATE requests/s for
# SECONDS_A_LEVEL, then closed loop at each of CLIENTS (none when empty: `CLIENTS=
# SECONDS_A_LEVEL=600` is ten minutes of open loop alone), the server's processes' memory every
# 30 s. It runs longer than one device call, so start it detached and collect its folder in a
# later call (while the machine is still held):
#   setsid nohup bash benchmarks/device/soak.sh > /dev/null 2>&1 < /dev/null &
#   ... later: tar czf $OUT/soak.tgz -C /tmp soak      (done when /tmp/soak/rc exists)
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
dir=/tmp/soak && mkdir -p $dir
( while [ ! -f $dir/rc ]; do date +%s >> $dir/rss.log
    ps -eo pid,rss,etime,args --sort=-rss | grep -E "dohnuts|uvicorn|python" | grep -v grep | head -14 >> $dir/rss.log
    sleep 30; done ) &
# CLIENTS may be empty (open loop alone), which run.py's arguments cannot say, so call it from a
# file of its own (the load's client processes are spawned: they import their parent's main
# module, which must be a file and guarded).
cat > $dir/soak.py <<EOF
from dohnuts.bench.batching import serving_workload

if __name__ == "__main__":
    serving_workload(requests=4096, rates=(${RATE:-150},), clients=tuple(int(c) for c in "${CLIENTS-64}".split()),
                     seconds=${SECONDS_A_LEVEL:-300}, warmup_seconds=5, workers=8, processes=4, client_cpus=4,
                     out="$dir/serving.json")
EOF
python3 $dir/soak.py > $dir/serving.log 2>&1
echo $? > $dir/rc
