#!/usr/bin/env bash
# Builds and runs README.md's program (the C++ block between its
# "readme_program.cc" markers, taken from the README's very text) as a
# program outside this repository, both ways a user's build takes this
# project in:
#   1. CMake: installs the build that tools/test_torch2.sh made (PyPI's torch
#      2.15; run that first) into a fresh prefix, then builds
#      testing/consumers/CMakeLists.txt (find_package(fsdp_cpp CONFIG),
#      fsdp_cpp::fsdp_cpp) against the installed package, and runs it with
#      the installed launcher, bin/fsdp_launch.
#   2. Bazel: a workspace outside the clone (~/.cache/fsdp_cpp/bazel-consumer,
#      rewritten each run, so its output base and cache persist) that names
#      this clone by local_repository and calls fsdp_cpp_repositories(), with
#      testing/consumers/BUILD.consumer (@fsdp_cpp//:fsdp_cpp) as its BUILD
#      file, run with @fsdp_cpp//:fsdp_launch; Debian's libtorch.
# Each way runs the program at W = 2 in a new directory (it trains from step
# 0 and saves a sharded checkpoint), then at another world size (1 for
# CMake, 3 for Bazel), which must load that checkpoint and go on from step 20
# with a lower loss than the first run started from. Fails when the program
# does not build, run or resume so.
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
awk '/^<!-- readme_program.cc: begin -->$/ {on = 1; next}
     /^<!-- readme_program.cc: end -->$/ {on = 0}
     on && !/^```/' README.md >"$work/train.cc"
if [[ ! -s "$work/train.cc" ]]; then
  echo "test_consumers: README.md has no program between its readme_program.cc markers" >&2
  exit 1
fi

# run_twice NAME W LAUNCHER PROGRAM: runs PROGRAM with LAUNCHER at W = 2 in
# a new directory, then at W there: the second run must resume from the
# first one's checkpoint.
run_twice() {
  local name=$1 other_world=$2 launcher=$3 program=$4
  local dir
  dir=$(mktemp -d "$work/run.XXXX")
  local first second
  first=$(cd "$dir" && "$launcher" --nproc_per_node=2 "$program" 2>"$dir/first.log") ||
    { cat "$dir/first.log" >&2; return 1; }
  second=$(cd "$dir" && "$launcher" --nproc_per_node="$other_world" "$program" \
             2>"$dir/second.log") || { cat "$dir/second.log" >&2; return 1; }
  python3 - "$name" "$other_world" "$first" "$second" <<'CHECK'
import re, sys
name, world, first, second = sys.argv[1:]
parse = lambda text: [(int(s), float(l)) for s, l in re.findall(r"^step (\d+) loss (\S+)$", text, re.M)]
a, b = parse(first), parse(second)
if not a or not b or a[0][0] != 0 or b[0][0] != 20 or not b[0][1] < a[0][1]:
    sys.exit("test_consumers: %s: the second run (W = %s) did not resume from the first's "
             "checkpoint:\n--- first run (W = 2):\n%s\n--- second run:\n%s" % (name, world, first, second))
print("%s: W = 2 steps 0-19, loss %.4f -> %.4f; resumed at W = %s from step 20, loss %.4f -> %.4f"
      % (name, a[0][1], a[-1][1], world, b[0][1], b[-1][1]))
CHECK
}
if ! torch_dir=$("$FSDP_TORCH_VENV/bin/python" -c \
                 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null); then
  echo "test_consumers: no torch in $FSDP_TORCH_VENV; run tools/install_deps.sh" >&2
  exit 1
fi
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
# The package installs only its public headers (tools/gen_cmake.py: those of
# libraries tagged internal stay behind); one that includes a header left
# behind would break every consumer that includes it.
missing=$(cd "$work/prefix/include" && find . -name '*.h' -exec \
            sed -n 's|^#include "\([a-z_]*/[^"]*\)".*|\1|p' {} + | sort -u |
          while read -r header; do
            if [[ -e "$repo/$header" && ! -e "$header" ]]; then echo "$header"; fi
          done)
if [[ -n "$missing" ]]; then
  echo "test_consumers: installed headers include headers the package does not install:" >&2
  echo "$missing" >&2
  exit 1
fi
source tools/ccache_launcher.sh
mkdir -p "$work/cmake-src"
cp testing/consumers/CMakeLists.txt "$work/train.cc" "$work/cmake-src/"
cmake -S "$work/cmake-src" -B "$work/cmake-consumer" -G Ninja "${launcher[@]}" \
  -DCMAKE_CXX_STANDARD=20 -DCMAKE_PREFIX_PATH="$work/prefix;$torch_dir" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/cmake-consumer" >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
run_twice "test_consumers: CMake (installed package, torch $FSDP_TORCH_VERSION)" 1 \
  "$work/prefix/bin/fsdp_launch" "$work/cmake-consumer/train"

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
rm -f "$consumer/train_two_ranks.cc"
cp "$work/train.cc" "$consumer/"
cat >"$consumer/.bazelrc" <<BAZELRC
build --spawn_strategy=processwrapper-sandbox
build --cxxopt=-std=c++17 --copt=-O2 --copt=-g0
build --disk_cache=~/.cache/fsdp_cpp/bazel-disk-cache --incompatible_strict_action_env
BAZELRC
status=0
(cd "$consumer" && bazel build --noshow_progress --ui_event_filters=-info,-stdout,-stderr \
   //:train @fsdp_cpp//:fsdp_launch 2>"$work/bazel.log") || status=$?
bin=""
if ((status == 0)); then
  bin=$(cd "$consumer" && bazel info bazel-bin 2>>"$work/bazel.log") || status=$?
fi
if ((status == 0)); then
  run_twice "test_consumers: Bazel (local_repository, Debian's libtorch)" 3 \
    "$bin/external/fsdp_cpp/launch/fsdp_launch" "$bin/train" || status=$?
else
  cat "$work/bazel.log" >&2
fi
(cd "$consumer" && bazel shutdown) || true  # A second Bazel server holds ~1 GB.
exit "$status"
