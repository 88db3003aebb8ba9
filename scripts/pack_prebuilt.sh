#!/usr/bin/env bash
# Packs binaries built here into prebuilt/bin.txz (git-ignored) for a device call that carries `prebuilt`
# (scripts/device_prebuilt.sh, scripts/device_ep_multi.sh unpack it there): stripped, xz-compressed, under the
# carry's 64 MiB, with this machine's libmpi_cxx.so.40 in lib/ for images that lack it. For NCCL runs build in a
# tree configured against the GPU image's NCCL 2.28.9 headers (the nvidia-nccl-cu13==2.28.9 wheel unpacked,
# NCCL_HOME=... cmake -S . -B build-mgpu).
# usage: BUILD=build-mgpu scripts/pack_prebuilt.sh moekit bench_dispatch test_cuda_ep ...
# XZ=9 by default: its 64 MiB window finds the CUTLASS kernels every test binary repeats (15 binaries: 13 MiB, 61 at
# xz -6).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
[ $# -gt 0 ] || { echo "usage: BUILD=dir $0 binary..." >&2; exit 2; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for b in "$@"; do
  [ -x "$BUILD/$b" ] || { echo "pack_prebuilt: $BUILD/$b is not a built binary" >&2; exit 2; }
  cp "$BUILD/$b" "$stage/" && strip "$stage/$b"
done
mpi_cxx=$(ldconfig -p 2>/dev/null | awk '/libmpi_cxx.so.40 /{print $NF; exit}')
[ -n "$mpi_cxx" ] && cp -L "$mpi_cxx" "$stage/lib/"
rm -rf prebuilt && mkdir prebuilt
tar -C "$stage" -cf - . | xz -"${XZ:-9}" -T2 > prebuilt/bin.txz
size=$(stat -c %s prebuilt/bin.txz)
echo "prebuilt/bin.txz: $# binaries, $((size / 1048576)) MiB"
[ "$size" -lt $((60 * 1048576)) ] || echo "pack_prebuilt: over 60 MiB: the carry (64 MiB with the tree) may refuse it" >&2
