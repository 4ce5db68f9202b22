#!/bin/bash
# Device run for issue 13 (speed helper): build, then the steps named in $STEPS.
# Run from the carried copy: bash tools/speed_dev.sh  (OUT must be set)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "=== $(( $(date +%s) - T0 )) s: $*"; }
stamp start
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || echo "WHEELS FAILED"
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv; uname -r; nproc; free -g; df -h /var/tmp; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; python3 -c 'import torch,safetensors;print(torch.__version__, safetensors.__version__)'; } > $OUT/env.txt 2>&1
stamp build
CUDA_HOME=/usr/local/cuda python3 setup.py -q build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { echo BUILD FAILED; tail -30 $OUT/build.log; exit 1; }
export PYTHONPATH=$PWD:/tmp/site
D=/var/tmp/speedbench
mkdir -p $D
for step in $STEPS; do
  stamp "$step"
  case $step in
    profile) timeout ${PROFILE_T:-120} python3 benchmarks/profile_load.py --dir $D --json $OUT/profile.json $PROFILE_ARGS ;;
    alloc) timeout 60 python3 benchmarks/bench_alloc.py --sizes 2GiB --kinds runtime_pinned,host_alloc --runs ${ALLOC_RUNS:-3} --json $OUT/alloc.json ;;
    moe) timeout ${MOE_T:-90} python3 benchmarks/bench_load.py --dir $D --layouts moe --cold moe --budget 4 --json $OUT/bench_moe.json $MOE_ARGS ;;
    dense) timeout ${DENSE_T:-120} python3 benchmarks/bench_load.py --dir $D --layouts dense --cold '' --budget 4 --json $OUT/bench_dense.json $DENSE_ARGS ;;
    densecold) timeout ${COLD_T:-120} python3 benchmarks/bench_load.py --dir $D --layouts dense --cold dense --skip-hot --json $OUT/bench_dense_cold.json $COLD_ARGS ;;
  esac
  echo "rc=$?"
done
stamp end
