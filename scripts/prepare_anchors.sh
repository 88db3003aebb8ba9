#!/usr/bin/env bash
# Fetches SonicMoE's wheels (a measuring stick for scripts/device_anchors.sh; nothing of it enters the project)
# into .anchors/ (git-ignored): the small wheels as they are, and the 78 MB nvidia-cutlass-dsl-libs-cu13 wheel
# unpacked and repacked as .anchors/cutlass_dsl_libs.tar.xz (xz -9e: 50 MiB, about 3 minutes on one core) so that
# .anchors (54 MiB) + .third_party/{nlohmann,wheels} (7 MiB) + the tree (2 MiB) stay under the device tool's
# 64 MiB carry (scripts/device_anchors.sh names the carry list).
# Idempotent (does nothing when everything is there). Versions: ../shared/docs/anchors.md. Needs pip + network.
set -euo pipefail
cd "$(dirname "$0")/.."
A=.anchors
SMALL="sonic-moe==0.1.2.post1 quack-kernels==0.4.1 apache-tvm-ffi==0.1.15.post2 nvidia-cutlass-dsl==4.4.2"
LIBS="nvidia-cutlass-dsl-libs-cu13==4.4.2"
# The GPU image's python3 is 3.12 (/opt/torch/.venv); device_anchors.sh checks it before installing.
PIP="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64"
mkdir -p $A/wheels
for spec in $SMALL; do
  name=$(echo "${spec%%==*}" | tr - _); ver=${spec##*==}
  ls $A/wheels/${name}-${ver}-*.whl >/dev/null 2>&1 || $PIP -d $A/wheels "$spec"
done
if [ ! -s $A/cutlass_dsl_libs.tar.xz ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  $PIP -d "$tmp" "$LIBS"
  mkdir "$tmp/tree" && (cd "$tmp/tree" && python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
  tar -C "$tmp/tree" -cf - . | xz -9e >$A/cutlass_dsl_libs.tar.xz.part
  mv $A/cutlass_dsl_libs.tar.xz.part $A/cutlass_dsl_libs.tar.xz
fi
ls -l $A/wheels $A/cutlass_dsl_libs.tar.xz
du -sh $A
