#!/usr/bin/env bash
# Builds one of the statedict readers' libFuzzer targets with clang
# (-fsanitize=fuzzer,address,undefined, against Debian's libtorch 1.13) and
# runs it for a fixed time on its committed corpus. Not part of CI: run by
# hand, and commit what it finds (statedict/fuzz/README.md).
#
#   tools/fuzz.sh restricted_unpickler|torch_file|dcp_metadata [SECONDS=300] [LIBFUZZER_FLAG...]
#
# (torch_file needs -detect_leaks=0 to get past a leak inside libtorch 1.13's
# archive reader; statedict/fuzz/README.md.)
#
# New inputs go to $FUZZ_OUT/<target>/corpus (default /tmp/fsdp_fuzz), crashes
# to $FUZZ_OUT/<target>/ as crash-*; the corpus in the tree stays as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: tools/fuzz.sh restricted_unpickler|torch_file|dcp_metadata [SECONDS]}
seconds=${2:-300}
out=${FUZZ_OUT:-/tmp/fsdp_fuzz}/$target
mkdir -p "$out/corpus"
case "$target" in
  restricted_unpickler) sources=(statedict/restricted_unpickler.cc base/status.cc) ;;
  torch_file|dcp_metadata)
    sources=(statedict/restricted_unpickler.cc statedict/torch_file.cc statedict/dcp.cc
             statedict/crc32.cc statedict/atomic_file.cc base/status.cc) ;;
  *) echo "fuzz.sh: no target '$target'" >&2; exit 2 ;;
esac
binary=$out/${target}_fuzzer
absl_libs=$(sed -n 's/^ *"-l\(absl_[a-z0-9_]*\)",$/-l\1/p' third_party/BUILD.bazel | sort -u | tr '\n' ' ')
echo "fuzz.sh: building $binary" >&2
clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I. "statedict/fuzz/${target}_fuzzer.cc" "${sources[@]}" -o "$binary" \
  -ltorch -ltorch_cpu -lc10 $absl_libs -lpthread
echo "fuzz.sh: running $target for $seconds s" >&2
"$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$out/" "${@:3}" "$out/corpus" "statedict/fuzz/corpus/$target"
