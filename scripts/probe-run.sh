export PYTHONPATH=.
timeout 300 python3 scripts/sm90-probe.py --no-check --graph --cells 128:0:1024,128:0:2048,128:0:4096,128:0:16384,128:1:8192,128:1:16384 --variant 128:pq2:persistent=true,q_buffers=2 --variant 128:plain:persistent=false > $OUT/fwd-probe-d128-persistent-q2.log 2>&1
grep -v "^warm" $OUT/fwd-probe-d128-persistent-q2.log | tail -8
