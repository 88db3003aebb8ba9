#!/usr/bin/env bash
# Builds the libFuzzer targets tests/fuzz/fuzz_*.cpp with clang (-fsanitize=fuzzer,address,undefined) and runs
# each for a bounded time on its committed seed corpus (tests/fuzz/corpus/<name>/) plus a working corpus kept
# in the build folder. Any crash, sanitizer report, leak, timeout or abort fails the script; the input that
# caused it is written to $BUILD/artifacts/. Used by `make fuzz` (and .ci/run with 30 s per target).
#   scripts/fuzz.sh [SECONDS_PER_TARGET=30] [TARGET...]     env: FUZZ_CXX (clang++), FUZZ_BUILD (build-fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-30}
shift || true
CXX=${FUZZ_CXX:-clang++}
BUILD=${FUZZ_BUILD:-build-fuzz}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang)" >&2; exit 2; }

FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined
       -fno-sanitize-recover=undefined -Iinclude -Isrc)
# The library code the targets reach; each object is rebuilt only when its source or a header changed.
SOURCES=(src/core/flags.cpp src/core/moe_flags.cpp src/core/config.cpp src/core/tensor.cpp
         src/io/safetensors.cpp src/io/atomic_file.cpp)
mkdir -p "$BUILD/obj" "$BUILD/artifacts"
newest_header=$(find include src/core src/io -name '*.h' -newer "$BUILD/obj" 2>/dev/null | head -1 || true)
objects=()
pids=()
for src in "${SOURCES[@]}"; do
    obj="$BUILD/obj/$(echo "$src" | tr / _).o"
    objects+=("$obj")
    if [[ ! -f "$obj" || "$src" -nt "$obj" || -n "$newest_header" ]]; then
        "$CXX" "${FLAGS[@]}" -c "$src" -o "$obj" &
        pids+=($!)
    fi
done
for p in "${pids[@]}"; do wait "$p"; done
touch "$BUILD/obj"

targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    for f in tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp | sed 's/^fuzz_//')"); done
fi
for name in "${targets[@]}"; do
    bin="$BUILD/fuzz_$name"
    "$CXX" "${FLAGS[@]/fuzzer-no-link/fuzzer}" "tests/fuzz/fuzz_$name.cpp" "${objects[@]}" -o "$bin"
    mkdir -p "$BUILD/corpus/$name"
    echo "fuzz.sh: $name for ${SECONDS_PER_TARGET}s"
    # -rss_limit_mb: the reader must refuse huge claims before allocating them; -timeout: no input may hang.
    set +e
    "$bin" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
        -artifact_prefix="$BUILD/artifacts/${name}-" -print_final_stats=1 \
        "$BUILD/corpus/$name" "tests/fuzz/corpus/$name" >"$BUILD/fuzz_$name.log" 2>&1
    status=$?
    set -e
    tail -n 40 "$BUILD/fuzz_$name.log" | grep -v '^"' | tail -n 8
    if [[ $status -ne 0 ]]; then
        echo "fuzz.sh: $name FAILED (status $status); reproducer in $BUILD/artifacts/" >&2
        exit 1
    fi
done
echo "fuzz.sh: all targets clean"
