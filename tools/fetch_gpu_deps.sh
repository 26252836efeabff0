#!/usr/bin/env bash
# Downloads, here where Debian's archive is reachable, the Debian packages
# that tools/gpu_verify.sh unpacks (dpkg -x) on a GPU machine that has a
# pip-installed torch but no network and none of them: abseil, googletest,
# google-benchmark, protobuf with protoc, and Gloo's headers (used there
# only if that torch ships none). About 5 MB, into .gpu_deps/ (git ignores
# it; carry it to the GPU machine with the working tree).
#
#   tools/fetch_gpu_deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  libabsl-dev libabsl20220623
  libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian
  libprotobuf-dev libprotobuf32 protobuf-compiler libprotoc32
  libgloo-dev
)
mkdir -p .gpu_deps
cd .gpu_deps
rm -f ./*.deb
if ! apt-get download "${packages[@]}"; then
  echo "fetch_gpu_deps: apt-get download failed; run 'apt-get update' first" >&2
  exit 1
fi
echo "fetch_gpu_deps: $(ls ./*.deb | wc -l) packages in .gpu_deps/ ($(du -sh . | cut -f1))"
