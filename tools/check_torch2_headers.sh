#!/bin/bash
# Compiles (syntax and templates, no linking) every C++ source of the
# repository against libtorch 2.x headers, to catch API drift between the
# libtorch 1.13 this machine builds with and the 2.x a GPU host's pip torch
# has. The headers are Debian trixie's libtorch-dev and libgloo-dev
# (downloaded from the Debian archive into ~/.cache/fsdp_cpp/torch2);
# the CUDA sources also need the CUDA toolkit headers (FSDP_CUDA_PATH,
# default /usr/local/cuda), and are skipped without them.
#
#   tools/check_torch2_headers.sh        # prints each failing file's errors
#   FSDP_CXX_STANDARD=c++20 tools/check_torch2_headers.sh   # as libtorch >= 2.13 needs
#
# Needs the Bazel build's generated headers (bazel build //formats/...).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${HOME}/.cache/fsdp_cpp/torch2"
archive="http://deb.debian.org/debian/pool/main"
debs=(
  "p/pytorch/libtorch-dev_2.6.0+dfsg-7_amd64.deb"
  "g/gloo/libgloo-dev_0.0~git20231202.5354032-3+b2_amd64.deb"
)
mkdir -p "${cache}/root"
for deb in "${debs[@]}"; do
  file="${cache}/$(basename "${deb}")"
  if [[ ! -s "${file}" ]]; then
    curl -fsS -o "${file}.part" "${archive}/${deb}"
    mv "${file}.part" "${file}"
    dpkg -x "${file}" "${cache}/root"
  fi
done
include="${cache}/root/usr/include"
if [[ ! -e bazel-bin/formats/checkpoint_manifest.pb.h ]]; then
  echo "check_torch2_headers: run 'bazel build //formats/...' first (generated headers)" >&2
  exit 2
fi

cuda="${FSDP_CUDA_PATH:-/usr/local/cuda}"
sources=$(git ls-files '*.cc' | grep -v -E '^third_party/(nccl_version|tsan_suppressions)\.cc$')
if [[ ! -e "${cuda}/include/nccl.h" ]]; then
  sources=$(echo "${sources}" | grep -v -E '^(comm/nccl_collectives(_benchmark)?|fsdp/cuda_test|models/cuda_step_benchmark)\.cc$')
fi

check_one() {
  local out
  if ! out=$(g++ -std="${STANDARD}" -fsyntax-only -DUSE_DISTRIBUTED -DUSE_C10D_GLOO -DUSE_C10D_NCCL -I. -Ibazel-bin \
      -isystem "${INCLUDE}" -isystem "${INCLUDE}/torch/csrc/api/include" \
      -isystem "${CUDA}/include" -isystem third_party/c10_cuda_shim "$1" 2>&1); then
    echo "=== $1"
    echo "${out}" | grep -E 'error' | head -10
    return 1
  fi
}
export -f check_one
export INCLUDE="${include}" CUDA="${cuda}" STANDARD="${FSDP_CXX_STANDARD:-c++17}"
count=$(echo "${sources}" | wc -l)
if echo "${sources}" | xargs -P "$(nproc)" -n 1 bash -c 'check_one "$0"'; then
  echo "check_torch2_headers: ${count} files compile against libtorch 2.6 headers (${STANDARD})"
else
  echo "check_torch2_headers: some of ${count} files do not compile against libtorch 2.6" >&2
  exit 1
fi
