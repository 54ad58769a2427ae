# tandem: `make demo` runs the main job on the default model, `make test` runs the test suite.
# Both install what is missing first (scripts/setup.sh) and are idempotent.
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)

.PHONY: all setup configure build test demo fidelity fuzz-smoke thread-safety tsan gpu-bundle gpu-check clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) -LE slow

demo: build
	@scripts/demo.sh $(BUILD)

fidelity: build
	@scripts/fidelity.sh $(BUILD)

# Clang's -Wthread-safety over the ABSL_GUARDED_BY & co annotations, on this build's compile
# commands (syntax only; `make test` runs it too, as the thread_safety test).
thread-safety: build
	@python3 scripts/thread_safety.py $(BUILD) -j $(JOBS)

# ThreadSanitizer: build-tsan/ (abseil, gRPC and cpp-httplib from their Debian source packages
# with TSan, then tandem) and the unit, component and fault tests under it (README.md).
tsan: setup
	@scripts/tsan.sh

# libFuzzer targets built with clang in build-fuzz/, ~20 s each (docs/fuzzing.md).
fuzz-smoke:
	@scripts/fuzz_smoke.sh 20

# GPU checks run from a prebuilt bundle (docs/gpu.md): `make gpu-bundle` builds the CUDA
# configuration for sm_90 here and packs GPU_BUNDLE (<= 48 MiB); `make gpu-check
# GPU_BUNDLE=archive` runs it on a GPU machine that has only the driver and the CUDA runtime
# (no cmake, no compiler) and prints one table. Set OUT=dir to keep the table and logs.
GPU_BUNDLE ?=
gpu-bundle:
	@scripts/gpu_bundle.sh $(or $(GPU_BUNDLE),tandem-gpu.tar.gz)

gpu-check:
	@GPU_BUNDLE=$(GPU_BUNDLE) scripts/gpu_check.sh

clean:
	rm -rf $(BUILD)
