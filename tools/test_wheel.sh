#!/usr/bin/env bash
# CI's wheel check (tox -e wheel): build the sdist and the repaired
# manylinux_2_28 wheel (tools/build_wheel.sh: CUDA 12 from PyPI's runtime
# wheels, no toolkit), check the sdist's contents, install the wheel into a
# fresh venv, and run the tests from the unpacked sdist against it (the
# core tests and those of what the wheel ships; the end of this file).
# Where `unshare -m` works (root), the install runs with the C compiler and
# the CUDA toolkit hidden: the wheel needs neither.
#
#   tools/test_wheel.sh [pytest args...]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$(command -v "${PYTHON:-python3}")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ist-testwheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1

# this machine's architecture: the wheel the tests below install
ARCHS="$(uname -m)" bash "$ROOT/tools/build_wheel.sh" "$WORK/dist"
WHEEL="$(ls "$WORK"/dist/*.whl)"
SDIST="$(ls "$WORK"/dist/*.tar.gz)"

# The sdist holds what the tests, CI and a reader need.
name="$(basename "$SDIST" .tar.gz)"
missing=0
tar -tzf "$SDIST" >"$WORK/sdist.list"
for f in LICENSE README.md pyproject.toml setup.py MANIFEST.in tox.ini .ci/run \
         _build_backend/instant_staging_build.py instant_staging/py.typed \
         _build_backend/backends.py instant_staging/_staging.pyi \
         tests/conftest.py tests/support/__init__.py tests/core/test_staging.py tools/build_wheel.sh; do
    grep -qxF "$name/$f" "$WORK/sdist.list" || { echo "test_wheel: sdist lacks $f"; missing=1; }
done
for d in docs benchmarks; do
    grep -q "^$name/$d/." "$WORK/sdist.list" || { echo "test_wheel: sdist lacks $d/"; missing=1; }
done
if grep -E '\.(c|so)$|_build_config\.py$' "$WORK/sdist.list"; then
    echo "test_wheel: sdist carries build outputs"; missing=1
fi
[ "$missing" = 0 ] || exit 1
echo "test_wheel: sdist contents ok ($(tar -tzf "$SDIST" | wc -l) entries)"
tar -xzf "$SDIST" -C "$WORK"

cat >"$WORK/install.sh" <<RUN
set -euo pipefail
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch==2.13.0
"$WORK/venv/bin/pip" install -q "$WHEEL[test]"
cd "$WORK"
"$WORK/venv/bin/instant-staging" --version
"$WORK/venv/bin/instant-staging" probe --size 64MiB --json >/dev/null
RUN
if unshare -m true 2>/dev/null; then
    mkdir "$WORK/empty"
    hide="mount --bind $WORK/empty /usr/local/cuda 2>/dev/null || true;"
    for cc in gcc cc gcc-12 x86_64-linux-gnu-gcc-12 c99 clang; do
        p="$(command -v $cc 2>/dev/null || true)"
        [ -n "$p" ] && hide="$hide mount --bind /bin/false $(readlink -f "$p");"
    done
    echo "test_wheel: installing with the C compiler and /usr/local/cuda hidden"
    unshare -m bash -c "$hide gcc --version >/dev/null 2>&1 && exit 99; bash $WORK/install.sh"
else
    bash "$WORK/install.sh"
fi

# The tests of the unpacked sdist against the installed wheel: the core
# tests (tests/conftest.py's "not slow": the runtime table, the state
# machine, the loader and the CLI in this process), then the slow modules
# that test what the wheel ships (its .pyi stubs against its compiled
# modules; a Cython caller that cimports its .pxd, the compiler visible
# again).  The rest of the slow tests (subprocess-heavy interrupts, the
# servers, the integrations) do not depend on how the package was built:
# the cuda env runs them, and all of them here would add 10 minutes to CI.
# pytest, not python -m pytest: the sdist's unbuilt package must not
# shadow the wheel.
cd "$WORK/$name"
"$WORK/venv/bin/pytest" -p no:cacheprovider -m "not slow" tests "$@"
"$WORK/venv/bin/pytest" -q -p no:cacheprovider tests/core/test_typing.py tests/core/test_cython_caller.py
