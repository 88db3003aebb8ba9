#!/usr/bin/env bash
# Copies the header/source-only dependencies into .third_party/ (git-ignored) so that the tree
# can be built on a GPU host that has no Debian packages: carry .third_party with the device tool.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .third_party
[ -d .third_party/googletest ] || cp -r /usr/src/googletest .third_party/googletest
[ -d .third_party/nlohmann ] || cp -r /usr/include/nlohmann .third_party/nlohmann
# The pinned CUTLASS wheel (headers for src/cuda/cutlass; 6.4 MB), unpacked by CMake at configure time.
[ -f .third_party/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl ] || \
  python3 -m pip download --quiet --no-deps --only-binary=:all: nvidia-cutlass==4.2.0.0 -d .third_party/wheels
echo "third-party sources in .third_party/"
