#!/usr/bin/env bash
# The serving soak on the GPU machine (issue 38): open loop at RATE requests/s for SECONDS, then
# closed loop at CLIENTS clients for SECONDS, the server's processes' memory every 30 s. It runs
# longer than one device call, so start it detached and collect its folder in a later call
# (while the machine is still held):
#   setsid nohup bash benchmarks/device/soak.sh > /dev/null 2>&1 < /dev/null &
#   ... later: tar czf $OUT/soak.tgz -C /tmp soak      (done when /tmp/soak/rc exists)
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
dir=/tmp/soak && mkdir -p $dir
( while [ ! -f $dir/rc ]; do date +%s >> $dir/rss.log
    ps -eo pid,rss,etime,args --sort=-rss | grep -E "dohnuts|uvicorn|python" | grep -v grep | head -14 >> $dir/rss.log
    sleep 30; done ) &
python3 benchmarks/run.py serving_workload --requests 4096 --rates "${RATE:-150}" --clients "${CLIENTS:-64}" \
  --seconds "${SECONDS_A_LEVEL:-300}" --warmup-seconds 5 --workers 8 --processes 4 --client-cpus 4 \
  --out $dir/serving.json > $dir/serving.log 2>&1
echo $? > $dir/rc
