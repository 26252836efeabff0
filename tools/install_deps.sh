#!/usr/bin/env bash
# Installs the Debian packages this project builds and runs with, and PyPI's
# torch 2.15.0 into a venv outside the clone ($FSDP_TORCH_VENV, by default
# ~/.cache/fsdp_cpp/torch-2.15.0-venv: about 5 GB, two minutes the first
# time) for the libtorch 2.x pass (tools/test_torch2.sh) and the interop
# tests' Python (tools/torch_python). Does nothing when all are present.
# Debian bookworm, as root or with sudo. Called by both commands in
# README.md and by .ci/run.
set -euo pipefail

packages=(
  bazel-bootstrap       # Bazel 4.2.3, fully offline
  bazel-rules-java      # @rules_java for Bazel's built-in tools
  bazel-platforms       # @platforms
  g++
  libtorch-dev          # libtorch 1.13.1, CPU, with c10d
  libgloo-dev           # Gloo headers that c10d's ProcessGroupGloo.hpp includes
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libprotobuf-dev
  protobuf-compiler
  libopenblas0-pthread  # without it libtorch's matmuls use the reference BLAS (~16x slower)
  python3-torch         # Debian's Python torch, for checkpoint interoperability tests
  python3-venv          # the venv that holds PyPI's torch
  cmake                 # the CMake build (CMakeLists.txt), which CI also checks
  ninja-build
  ccache                # keeps CI's CMake rebuilds incremental
  nlohmann-json3-dev    # JSON of Hugging Face's files (hf/)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} > 0)); then
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  echo "install_deps: installing ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# libtorch links libblas.so.3, which must resolve to OpenBLAS.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 || true)
if [[ "$blas" != *openblas* ]]; then
  echo "install_deps: libblas.so.3 is $blas, not OpenBLAS; run" \
       "'update-alternatives --config libblas.so.3-x86_64-linux-gnu'" >&2
  exit 1
fi

# PyPI's torch: a CUDA build (it runs on CPU too) whose wheel holds libtorch
# with headers, CMake config, libtorch_cuda and c10_cuda, and pulls in the
# CUDA libraries (nvidia-nccl among them) as pip packages beside it.
# NumPy beside it: multi-rank torch.distributed.checkpoint.save moves its
# plans with gather_object, which needs it (the DCP interop tests).
# safetensors: the Hugging Face format's reference reader and writer (the
# safetensors interop test). transformers: the reference Llama, Qwen2 and
# Qwen3 models, built from a config with no download (the llama parity test).
# peft: the reference LoRA adapters (the LoRA parity test); it pulls in
# accelerate and psutil.
source "$(dirname "$0")/torch_venv.sh"
if ! "$FSDP_TORCH_VENV/bin/python" -c \
    "import sys, numpy, torch, safetensors, transformers, peft
sys.exit(torch.__version__.split('+')[0] != '$FSDP_TORCH_VERSION'
         or safetensors.__version__ != '$FSDP_SAFETENSORS_VERSION'
         or transformers.__version__ != '$FSDP_TRANSFORMERS_VERSION'
         or peft.__version__ != '$FSDP_PEFT_VERSION')" \
    2>/dev/null; then
  echo "install_deps: installing torch==$FSDP_TORCH_VERSION, numpy==$FSDP_NUMPY_VERSION," \
       "safetensors==$FSDP_SAFETENSORS_VERSION, transformers==$FSDP_TRANSFORMERS_VERSION" \
       "and peft==$FSDP_PEFT_VERSION" \
       "from PyPI into $FSDP_TORCH_VENV" >&2
  /usr/bin/python3 -m venv "$FSDP_TORCH_VENV"
  "$FSDP_TORCH_VENV/bin/pip" install -q --disable-pip-version-check \
    "torch==$FSDP_TORCH_VERSION" "numpy==$FSDP_NUMPY_VERSION" \
    "safetensors==$FSDP_SAFETENSORS_VERSION" \
    "transformers==$FSDP_TRANSFORMERS_VERSION" "peft==$FSDP_PEFT_VERSION"
fi
