# Sourced at the start of a command on the GPU machine: unpack .gpusite and install .whl's wheels
# under /tmp (once a machine), then the environment; `stamp TEXT` appends a timed line to
# $OUT/timeline.txt. Run state that must outlive a call goes under /tmp, never in the working
# tree: each call's copy of the tree removes what is not in it.
mkdir -p /tmp/gs /tmp/site
[ -d /tmp/gs/site ] || tar -xJf .gpusite/site.tar.xz -C /tmp/gs
[ -f /tmp/site/.done ] || { pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl && touch /tmp/site/.done; }
export PYTHONPATH=/tmp/gs/site:/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/gs/site/z3/lib:${LD_LIBRARY_PATH:-}
export PATH=/tmp/site/bin:$PATH
t0=${t0:-$(date +%s)}
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/timeline.txt"; }
# The device tool brings back a few files only: pack $OUT into one archive before the command ends.
pack_out() { (cd "$OUT" && tar czf /tmp/out.tgz . && rm -rf ./* && mv /tmp/out.tgz .); }
