#!/usr/bin/env bash
# GPU check of the CUDA 12 build, for a GPU host without network (the H200:
# driver 580, toolkit 13 at /usr/local/cuda, Python 3.12).
#
#   bash tools/gpu_cuda12_check.sh [WHEELDIR]      (default: .whl/cuda12)
#
# WHEELDIR holds, for the host's Python: setuptools>=77, Cython>=3.0,
# nvidia-cuda-runtime-cu12==12.9.79 and nvidia-cuda-nvcc-cu12==12.9.86
# (_build_backend/backends.py, CUDA_WHEELS[12]).  Builds the package as
# pip does for a user, isolated, with the in-tree backend fetching the
# CUDA 12 runtime wheels from WHEELDIR (INSTANT_STAGING_CUDA=12 passes the
# CUDA 13 toolkit over), into a scratch site dir; then, against that build:
# readelf -d of the CUDA module (no libcudart NEEDED), doctor, probe
# --require-gpu --json, and pytest -m gpu.  Results go to $OUT (or
# ./gpu-cuda12-out); the exit status is that of the first failing step.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS="$(cd "${1:-$ROOT/.whl/cuda12}" && pwd)"
OUTDIR="${OUT:-$ROOT/gpu-cuda12-out}"
mkdir -p "$OUTDIR"
SITE="$(mktemp -d /tmp/ist-cuda12-site.XXXXXX)"
PY="$(command -v python3)"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
status=0
step() { local name="$1"; shift; echo "== $name"; "$@"; local rc=$?; echo "== $name: exit $rc";
         [ "$rc" = 0 ] || [ "$status" != 0 ] || status=$rc; return 0; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUTDIR/gpu.txt"

build() {
    INSTANT_STAGING_BACKEND=cuda INSTANT_STAGING_CUDA=12 \
        "$PY" -m pip install -v --no-index --find-links "$WHEELS" --no-deps --no-cache-dir \
        --target "$SITE" "$ROOT" >"$OUTDIR/build.log" 2>&1
    local rc=$?
    grep -E "instant_staging: |Successfully|error" "$OUTDIR/build.log" | head -20
    return $rc
}
step "build (CUDA 12 from wheels, isolated)" build
[ "$status" = 0 ] || { tail -40 "$OUTDIR/build.log"; exit "$status"; }

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd /tmp   # never the unbuilt sources in $ROOT
so="$(ls "$SITE"/instant_staging/runtime/_cuda*.so)"
readelf_check() {
    readelf -d "$so" | tee "$OUTDIR/readelf.txt"
    ! grep NEEDED "$OUTDIR/readelf.txt" | grep -q libcudart
}
step "readelf -d $(basename "$so") (no libcudart NEEDED)" readelf_check
step "version" "$PY" -m instant_staging --version
step "build config" cat "$SITE/instant_staging/_build_config.py"
step "doctor" bash -c "'$PY' -m instant_staging doctor | tee '$OUTDIR/doctor.txt'"
step "probe --require-gpu --json" bash -c "'$PY' -m instant_staging probe --require-gpu --json > '$OUTDIR/probe.json'; rc=\$?; '$PY' -c 'import json; d=json.load(open(\"$OUTDIR/probe.json\")); print({k: d.get(k) for k in (\"ok\", \"kind\", \"runtime_version\", \"driver_version\", \"simulated\")}, d[\"copy\"] and {k: d[\"copy\"][k] for k in (\"h2d_gbps\", \"d2h_gbps\", \"verified\")})'; exit \$rc"
step "probe --require-gpu (failing host: register=invalid_value)" \
    "$PY" -m instant_staging probe --require-gpu --faults register=invalid_value
step "pytest -m gpu" bash -c "'$PY' -m pytest -q -p no:cacheprovider -m gpu '$ROOT/tests' 2>&1 | tee '$OUTDIR/pytest-gpu.txt' | tail -15; exit \${PIPESTATUS[0]}"
echo "gpu_cuda12_check: exit $status"
exit "$status"
