#!/usr/bin/env bash
# Builds one of the file readers' libFuzzer targets with clang
# (-fsanitize=fuzzer,address,undefined, against Debian's libtorch 1.13) and
# runs it for a fixed time on its committed corpus. Not part of CI: run by
# hand, and commit what it finds (formats/fuzz/README.md).
#
#   tools/fuzz.sh restricted_unpickler|torch_file|dcp_metadata|sharded_manifest|safetensors [SECONDS=300] [LIBFUZZER_FLAG...]
#
# (torch_file needs -detect_leaks=0 to get past a leak inside libtorch 1.13's
# archive reader; formats/fuzz/README.md.)
#
# New inputs go to $FUZZ_OUT/<target>/corpus (default /tmp/fsdp_fuzz), crashes
# to $FUZZ_OUT/<target>/ as crash-*; the corpus in the tree stays as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: tools/fuzz.sh restricted_unpickler|torch_file|dcp_metadata|sharded_manifest|safetensors [SECONDS]}
seconds=${2:-300}
extra_libs=()
proto_dir=
out=${FUZZ_OUT:-/tmp/fsdp_fuzz}/$target
mkdir -p "$out/corpus"
# Where the target's source and committed corpus are: the pure formats'
# fuzzers live in formats/fuzz; the SHARDED manifest's, which loads into a
# model, in statedict/fuzz; the safetensors reader's in hf/fuzz.
fuzz_dir=formats/fuzz
case "$target" in
  restricted_unpickler) sources=(formats/restricted_unpickler.cc base/status.cc) ;;
  torch_file|dcp_metadata)
    sources=(formats/restricted_unpickler.cc formats/torch_file.cc formats/torch_zip.cc
             formats/dcp.cc formats/dcp_metadata_reader.cc formats/dcp_writer.cc
             formats/crc32.cc formats/atomic_file.cc base/status.cc) ;;
  sharded_manifest)
    fuzz_dir=statedict/fuzz
    # The loader with everything it links (the FSDP core included, as
    # sharded_checkpoint.cc saves and loads models too), and the manifest's
    # generated protobuf code.
    # (Generated in a temporary directory, copied to $out/proto only when
    # it changed, so that the objects that include it stay up to date.)
    proto_dir=$out/proto
    proto_tmp=$(mktemp -d)
    protoc --proto_path=. --cpp_out="$proto_tmp" formats/checkpoint_manifest.proto
    mkdir -p "$proto_dir/formats"
    for f in checkpoint_manifest.pb.h checkpoint_manifest.pb.cc; do
      cmp -s "$proto_tmp/formats/$f" "$proto_dir/formats/$f" ||
        cp "$proto_tmp/formats/$f" "$proto_dir/formats/$f"
    done
    rm -r "$proto_tmp"
    sources=(statedict/sharded_checkpoint.cc statedict/model_tensors.cc statedict/load_check.cc
             formats/crc32.cc formats/atomic_file.cc "$proto_dir/formats/checkpoint_manifest.pb.cc"
             comm/collectives.cc comm/fingerprint.cc base/status.cc base/device_event.cc
             fsdp/activation_checkpointing.cc fsdp/comm_hooks.cc
             fsdp/cross_rank_checks.cc fsdp/flat_layout.cc fsdp/flat_param_handle.cc
             fsdp/fsdp_options.cc fsdp/gradient_reduction.cc fsdp/fully_shard.cc fsdp/runtime_streams.cc fsdp/trace.cc fsdp/unit_forward.cc
             fsdp/unit_init.cc fsdp/unit_registry.cc fsdp/unit_scheduler.cc fsdp/utilities.cc
             fsdp/wrap_plan.cc policies/wrap_policy.cc policies/unit_options.cc policies/policy_spec.cc)
    extra_libs=(-lprotobuf) ;;
  safetensors)
    fuzz_dir=hf/fuzz
    sources=(hf/safetensors.cc formats/atomic_file.cc base/status.cc) ;;
  *) echo "fuzz.sh: no target '$target'" >&2; exit 2 ;;
esac
binary=$out/${target}_fuzzer
absl_libs=$(sed -n 's/^ *"-l\(absl_[a-z0-9_]*\)",$/-l\1/p' third_party/BUILD.bazel | sort -u | tr '\n' ' ')
echo "fuzz.sh: building $binary" >&2
# One object per source in $out/obj, compiled in parallel; a source is
# compiled again only when it or a header it includes changed (clang's -MMD).
export FUZZ_CXXFLAGS="-std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined
  -fno-sanitize-recover=undefined -I. -isystem /usr/include/torch/csrc/api/include
  ${proto_dir:+-I$proto_dir}"
objects=()
stale=()
for src in "$fuzz_dir/${target}_fuzzer.cc" "${sources[@]}"; do
  obj=$out/obj/$(echo "$src" | tr '/' '_').o
  objects+=("$obj")
  if [[ -f $obj && -f ${obj%.o}.d ]]; then
    up_to_date=1
    for dep in $(sed -e 's/^[^:]*://' -e 's/\\$//' "${obj%.o}.d"); do
      if [[ ! -e $dep || $dep -nt $obj ]]; then up_to_date=0; break; fi
    done
    ((up_to_date)) && continue
  fi
  stale+=("$src" "$obj")
done
mkdir -p "$out/obj"
if ((${#stale[@]})); then
  printf '%s\0' "${stale[@]}" | xargs -0 -n2 -P "$(nproc)" sh -c \
    'exec clang++ $FUZZ_CXXFLAGS -MMD -MF "${1%.o}.d" -c "$0" -o "$1"'
fi
# shellcheck disable=SC2086
clang++ $FUZZ_CXXFLAGS "${objects[@]}" -o "$binary" \
  "${extra_libs[@]}" -ltorch -ltorch_cpu -lc10 $absl_libs -lpthread
echo "fuzz.sh: running $target for $seconds s" >&2
"$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$out/" "${@:3}" "$out/corpus" "$fuzz_dir/corpus/$target"
