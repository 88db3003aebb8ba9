# Two entry points; each sets itself up on a fresh machine (packages, configure, build).
#   make demo   trains a small MoE model with `moekit train` (CPU backend unless a GPU is present)
#   make test   builds and runs the whole test suite through ctest
# Also run by CI after `make test` (.ci/run):
#   make test-asan   the CPU suite built with ASan+UBSan in build-asan (CUDA off)
#   make fuzz        the libFuzzer targets of tests/fuzz, FUZZ_SECONDS each (scripts/fuzz.sh; clang)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all demo test test-asan fuzz deps cutlass-wheel configure build clean

all: build

# Debian packages the build needs; installed only when missing.
# clang and libclang-rt-dev: the libFuzzer targets (make fuzz); OpenMPI: CPU ranks (mpirun); python3: bench/anchors' test.
DEB_PACKAGES := cmake g++ make libgtest-dev nlohmann-json3-dev clang libclang-rt-dev libopenmpi-dev openmpi-bin python3
deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "moekit: installing$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# The CUTLASS headers (second grouped-GEMM backend; CUDA builds only) come from the pinned nvidia-cutlass wheel on
# PyPI, kept in .third_party/wheels (the GPU hosts get it carried there: they reach no registry).
CUTLASS_WHEEL := .third_party/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl
cutlass-wheel:
	@if [ ! -f $(CUTLASS_WHEEL) ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then \
	  echo "moekit: fetching the CUTLASS headers (nvidia-cutlass==4.2.0.0 from PyPI)"; \
	  python3 -m pip download --quiet --no-deps --only-binary=:all: nvidia-cutlass==4.2.0.0 -d .third_party/wheels \
	    || echo "moekit: no CUTLASS wheel: the CUTLASS grouped GEMMs are not built"; \
	fi

configure: deps cutlass-wheel
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/moekit train --out-dir $(BUILD)/demo --overwrite

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

# Sanitizer build of the CPU suite: any memory error, leak or undefined behaviour fails the test it occurs in.
ASAN_BUILD ?= build-asan
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
test-asan: deps
	@test -f $(ASAN_BUILD)/CMakeCache.txt || cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=OFF \
	  -DCMAKE_CXX_FLAGS="$(SANITIZE)" -DCMAKE_EXE_LINKER_FLAGS="$(SANITIZE)" $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest -L cpu --output-on-failure -j $(JOBS) --timeout 900

FUZZ_SECONDS ?= 30
fuzz: deps
	scripts/fuzz.sh $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) build-fuzz
