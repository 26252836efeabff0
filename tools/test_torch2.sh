#!/usr/bin/env bash
# The whole suite against PyPI's torch 2.15 (the venv tools/install_deps.sh
# makes; tools/torch_venv.sh): every target built with CMake and C++20
# against that wheel's libtorch, the CUDA targets included (linked against
# its libtorch_cuda, c10_cuda and the NCCL of its nvidia-nccl package;
# nothing runs on a GPU here), then every test run by CTest with the interop
# tests' Python set to the venv's, as many at a time as there are cores (as
# Bazel runs them; those Bazel runs alone, RUN_SERIAL). Ends with "N passed,
# N failed" over the individual gtest cases. Arguments go to ctest (say,
# -R fingerprint).
#
# CMake rather than Bazel: CMake is how libtorch users build against a pip
# torch or the LibTorch archive, the wheel's TorchConfig.cmake carries its
# compile definitions and ABI flags, and the Bazel workspace's libtorch is
# Debian's (WORKSPACE). The CMake targets are generated from the BUILD files
# (tools/gen_cmake.py), so the two builds cannot drift.
#
# The build directory is FSDP_TORCH2_BUILD_DIR (default build-torch2/, which
# git ignores); ccache keeps rebuilds incremental across clones.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/torch_venv.sh

python3 tools/gen_cmake.py --check || exit 1
python="$FSDP_TORCH_VENV/bin/python"
if ! torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' \
                 2>/dev/null); then
  echo "test_torch2: no torch in $FSDP_TORCH_VENV; run tools/install_deps.sh" >&2
  exit 1
fi
build=${FSDP_TORCH2_BUILD_DIR:-build-torch2}
source tools/ccache_launcher.sh
# TorchConfig.cmake otherwise compiles and runs a CUDA program to find the
# GPUs' architectures, which fails without a GPU; we compile no device code.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# The package directory (not torch.utils.cmake_prefix_path): see
# CMakeLists.txt on Debian's libtorch beside a pip torch.
mkdir -p "$build"
if ! cmake -S . -B "$build" -G Ninja "${launcher[@]}" -DCMAKE_PREFIX_PATH="$torch_dir" \
     -DCMAKE_CXX_STANDARD=20 -DFSDP_CUDA=ON >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  exit 1
fi
grep '^-- fsdp:' "$build/configure.log"
cmake --build "$build" -- -j"$(nproc)" || exit 1

xml_dir="$(realpath "$build")/gtest_xml"
rm -rf "$xml_dir"
mkdir -p "$xml_dir"
# The GPU test needs a GPU; everything else runs here.
FSDP_TORCH_PYTHON="$python" GTEST_OUTPUT="xml:$xml_dir/" \
  ctest --test-dir "$build" --output-on-failure -LE gpu -j"$(nproc)" "$@"
status=$?

source tools/gtest_counts.sh
gtest_counts "$status" < <(find "$xml_dir" -name '*.xml')
exit $status
