#!/usr/bin/env bash
# Builds and runs testing/consumers/train_two_ranks.cc as a program outside
# this repository, both ways a user's build takes this project in:
#   1. CMake: installs the build that tools/test_torch2.sh made (PyPI's torch
#      2.15; run that first) into a fresh prefix, then builds
#      testing/consumers/CMakeLists.txt against the installed package
#      (find_package(fsdp_cpp CONFIG)).
#   2. Bazel: a workspace outside the clone (~/.cache/fsdp_cpp/bazel-consumer,
#      rewritten each run, so its output base and cache persist) that names
#      this clone by local_repository and calls fsdp_cpp_repositories(), with
#      testing/consumers/BUILD.consumer as its BUILD file; Debian's libtorch.
# Each prints the program's line and fails if it does not build or run.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
source tools/torch_venv.sh

build=${FSDP_TORCH2_BUILD_DIR:-build-torch2}
if [[ ! -e "$build/CMakeCache.txt" ]]; then
  echo "test_consumers: no $build; run tools/test_torch2.sh first" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! torch_dir=$("$FSDP_TORCH_VENV/bin/python" -c \
                 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null); then
  echo "test_consumers: no torch in $FSDP_TORCH_VENV; run tools/install_deps.sh" >&2
  exit 1
fi
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
source tools/ccache_launcher.sh
cmake -S testing/consumers -B "$work/cmake-consumer" -G Ninja "${launcher[@]}" \
  -DCMAKE_CXX_STANDARD=20 -DCMAKE_PREFIX_PATH="$work/prefix;$torch_dir" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/cmake-consumer" >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
echo -n "test_consumers: CMake (installed package, torch $FSDP_TORCH_VERSION): "
"$work/cmake-consumer/train_two_ranks"

consumer=$HOME/.cache/fsdp_cpp/bazel-consumer
mkdir -p "$consumer"
cat >"$consumer/WORKSPACE" <<WORKSPACE
workspace(name = "consumer")

local_repository(name = "fsdp_cpp", path = "$repo")

load("@fsdp_cpp//third_party:repositories.bzl", "fsdp_cpp_repositories")

fsdp_cpp_repositories()

# What every workspace needs from Debian's offline Bazel 4.2.3 (this
# repository's WORKSPACE says why).
local_repository(name = "rules_java", path = "/usr/share/bazel/rules/java")

local_repository(name = "platforms", path = "/usr/share/bazel/tools/platforms")

local_repository(name = "rules_cc", path = "$repo/third_party/rules_cc")

local_repository(name = "remote_coverage_tools", path = "$repo/third_party/remote_coverage_tools")
WORKSPACE
cp testing/consumers/BUILD.consumer "$consumer/BUILD.bazel"
cp testing/consumers/train_two_ranks.cc "$consumer/"
cat >"$consumer/.bazelrc" <<BAZELRC
build --spawn_strategy=processwrapper-sandbox
build --cxxopt=-std=c++17 --copt=-O2 --copt=-g0
build --disk_cache=~/.cache/fsdp_cpp/bazel-disk-cache
BAZELRC
echo -n "test_consumers: Bazel (local_repository, Debian's libtorch): "
status=0
(cd "$consumer" && bazel run --noshow_progress --ui_event_filters=-info,-stdout,-stderr \
   //:train_two_ranks 2>"$work/bazel.log") || status=$?
(cd "$consumer" && bazel shutdown) || true  # A second Bazel server holds ~1 GB.
if ((status != 0)); then
  cat "$work/bazel.log" >&2
  exit "$status"
fi
