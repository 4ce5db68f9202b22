#!/usr/bin/env bash
# AddressSanitizer check of instant_staging's compiled code.
#
# Builds the extensions with INSTANT_STAGING_SANITIZE=address (setup.py adds
# -fsanitize=address -fno-omit-frame-pointer -g) in a scratch copy of the
# tree, so the normal in-place build is left alone, then runs the CPU test
# suite with libasan preloaded into the (uninstrumented) interpreter.
#
#   tools/asan_check.sh [pytest args...]      default: the whole tests/ tree
#
# ASAN_OPTIONS: detect_leaks=0 because CPython leaks by design at exit;
# every report goes to a log file per process (children and forks too).
# PYTHONMALLOC=malloc routes Python objects through ASan's allocator, so a
# use-after-free of one is caught as well.  HYPOTHESIS_PROFILE defaults to
# "quick" (200 examples a property; everything is several times slower).
# Deselected: test_simulated.py::test_dealloc_frees_leftovers measures RSS,
# which ASan's quarantine keeps up (test_soak.py skips its RSS bound alone).
#
# Exit status: 0 when the tests pass and no report has a frame in this
# package; 1 otherwise.  Reports whose frames are all outside the package
# (the interpreter, libc, other extensions) are listed but do not fail.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ist-asan.XXXXXX")"
KEEP="${ASAN_CHECK_KEEP:-0}"
cleanup() { if [ "$KEEP" = 1 ]; then echo "asan_check: kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

# The tree as git sees it (tracked and untracked, not ignored): no stale
# build outputs, no .so from a normal build.  Outside a git checkout (an
# sdist), everything but build outputs.
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) \
        | (cd "$ROOT" && xargs -0 cp --parents -t "$WORK")
else
    cp -a "$ROOT/." "$WORK"
    rm -rf "$WORK/build" "$WORK/.tox"
    find "$WORK/instant_staging" -name '*.so' -delete
    # Cython's generated C, not hand-written C (instant_staging/_shims/).
    find "$WORK/instant_staging" -name '*.pyx' | while read -r pyx; do rm -f "${pyx%.pyx}.c"; done
fi

cd "$WORK"
echo "asan_check: building with AddressSanitizer in $WORK"
INSTANT_STAGING_SANITIZE=address python setup.py build_ext --inplace >build.log 2>&1 || {
    tail -40 build.log; echo "asan_check: build failed"; exit 1; }

LIBASAN="$(${CC:-gcc} -print-file-name=libasan.so)"
if [ ! -e "$LIBASAN" ]; then
    echo "asan_check: libasan.so not found (gcc -print-file-name=libasan.so gave $LIBASAN)"; exit 1
fi
# The extensions must really be instrumented, or the run proves nothing.
for so in instant_staging/_staging*.so instant_staging/runtime/_simulated*.so; do
    # (grep without -q: an early exit would SIGPIPE nm and fail the pipeline)
    nm -D "$so" | grep __asan_report >/dev/null || { echo "asan_check: $so is not instrumented"; exit 1; }
done

LOGS="$WORK/asan-logs"
mkdir -p "$LOGS"
set +e
env LD_PRELOAD="$LIBASAN" \
    ASAN_OPTIONS="detect_leaks=0:log_path=$LOGS/asan:allocator_may_return_null=1:detect_stack_use_after_return=0" \
    PYTHONMALLOC=malloc \
    HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-quick}" \
    python -m pytest -q -p no:cacheprovider \
        --deselect tests/core/test_simulated.py::test_dealloc_frees_leftovers \
        "${@:-tests}"
tests_rc=$?
set -e

ours=0
others=0
for log in "$LOGS"/asan.*; do
    [ -e "$log" ] || continue
    # A frame line reads "#3 0x7f.. in func /path/file.c:12" or "(module.so+0x..)".
    if grep -E '^ +#[0-9]+ ' "$log" | grep -q 'instant_staging'; then
        ours=$((ours + 1))
        echo "asan_check: REPORT IN instant_staging FRAMES: $log"
        sed -n '1,60p' "$log"
    else
        others=$((others + 1))
        echo "asan_check: report outside this package (not failing): $log"
        grep -m1 'ERROR: AddressSanitizer' "$log" || head -3 "$log"
    fi
done

echo "asan_check: tests exit status $tests_rc; reports in instant_staging frames: $ours; elsewhere: $others"
if [ "$tests_rc" -ne 0 ] || [ "$ours" -ne 0 ]; then
    exit 1
fi
