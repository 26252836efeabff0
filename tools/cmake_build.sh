#!/usr/bin/env bash
# The CMake path (CMakeLists.txt): checks that cmake/targets.cmake matches
# the BUILD files, builds every target against the libtorch CMake finds
# (Debian's here), and runs the tests with CTest. Arguments go to ctest.
# The build directory is FSDP_CMAKE_BUILD_DIR (default build-cmake/, which
# git ignores); object files are cached by ccache outside the clone when it
# is installed, so CI rebuilds are incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 tools/gen_cmake.py --check
build=${FSDP_CMAKE_BUILD_DIR:-build-cmake}
source tools/ccache_launcher.sh
cmake -S . -B "$build" -G Ninja "${launcher[@]}" >/dev/null
cmake --build "$build" -- -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure "$@"
