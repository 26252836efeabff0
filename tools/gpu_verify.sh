#!/usr/bin/env bash
# The GPU path's checks, on a machine with a CUDA GPU and a pip-installed
# CUDA torch (docs/building.md, "GPU builds"): builds the CUDA targets with CMake
# against that torch, runs //fsdp:cuda_test (world size 1 over NCCL, and 2
# and 3 ranks sharing the GPU through staged collectives; the single-process
# cases again under compute-sanitizer's memcheck where installed), trains the main
# job on the GPU (one rank over NCCL, with the flat-shard optimizer's exact
# and fused kernels; two ranks sharing the GPU, staged; checkpoints saved
# there and resumed, blocking and in the background; a small Hugging Face
# Llama fine-tuned with LoRA in
# bfloat16 with activation checkpointing, one rank and two sharing the GPU),
# runs the training-step benchmark on both sides (ours, models/cuda_step_benchmark.cc;
# PyTorch's FullyShardedDataParallel and fully_shard,
# models/fsdp_step_benchmark.py) and writes them side by side; with two GPUs
# or more, also the NCCL transports against each other
# (comm/nccl_collectives_benchmark.cc). With
# --cpu-tests it then builds every target and runs the CPU test suite against
# that torch too.
#
#   tools/fetch_gpu_deps.sh                       # first, where apt works
#   tools/gpu_verify.sh [--cpu-tests] OUT_DIR     # on the GPU machine
#
# Needs there: python3 with the CUDA torch, cmake, ninja, g++, the CUDA
# toolkit; abseil, googletest, google-benchmark and protobuf come from the
# Debian packages in .gpu_deps/ (FSDP_GPU_DEPS), unpacked with dpkg -x.
# Writes to OUT_DIR at most 8 files: summary.txt (each stage's outcome),
# build.log, cuda_test.log (with the activation-checkpointing test's CUDA
# case, the main job's runs and activation checkpointing's memory runs),
# cpp_step.json, pytorch_step.jsonl, step_table.md, nccl.json (two GPUs or
# more) or cpp_step_w2.json (one GPU: two ranks sharing it), ctest.log. A
# failing stage is recorded and the next runs; each run has a time limit.
set -uo pipefail
cd "$(dirname "$0")/.."

cpu_tests=0
if [[ "${1:-}" == "--cpu-tests" ]]; then
  cpu_tests=1
  shift
fi
out=${1:?usage: tools/gpu_verify.sh [--cpu-tests] OUT_DIR}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
stage() {  # stage NAME LOG COMMAND...: runs it, appending to LOG, and notes the outcome.
  local name=$1 log=$2 start=$SECONDS
  shift 2
  if "$@" >>"$log" 2>&1; then
    note "$name: ok ($((SECONDS - start)) s)"
  else
    note "$name: FAILED, exit $? ($((SECONDS - start)) s; see $(basename "$log"))"
    return 1
  fi
}

# The main job succeeds whatever its loss does; a stage that trains it also
# needs it to have learned: its "loss A -> B over steps" line must fall.
loss_falls() {  # loss_falls COMMAND...: runs it, printing its output.
  local output status
  output=$("$@" 2>&1)
  status=$?
  echo "$output"
  ((status == 0)) || return $status
  awk '/^loss [0-9.]+ -> [0-9.]+ over steps/ { fell = ($4 < $2) } END { exit !fell }' \
    <<<"$output" || { echo "loss_falls: the loss did not fall"; return 1; }
}

checkpoints_on_gpu() {  # checkpoints_on_gpu TRAIN_GPT DIR
  local job=$1 dir=$2 output
  rm -rf "$dir"
  local common=(--device=cuda --world_size=1 --print_plan=false --log_every=10)
  timeout -k 10 90 "$job" "${common[@]}" --steps=20 --checkpoint_every=10 \
    --checkpoint_dir="$dir/run" || return 1
  output=$(timeout -k 10 90 "$job" "${common[@]}" --steps=30 --resume \
    --checkpoint_dir="$dir/run" 2>&1) || { echo "$output"; return 1; }
  echo "$output"
  grep -q "resumed from $dir/run/step-00000020" <<<"$output" || return 1
  output=$(timeout -k 10 90 "$job" "${common[@]}" --steps=3 --lr=1e30 --checkpoint_every=1 \
    --checkpoint_dir="$dir/blown" 2>&1)
  local status=$?
  echo "$output"
  ((status == 1)) && grep -q "the updated weights give a loss of" <<<"$output" &&
    [[ ! -e "$dir/blown/step-00000001" ]]
}

# --async_checkpoint on the GPU (each rank's shards copied into pinned host
# memory on a side stream that the next step waits for): the losses are the
# blocking run's, and its last checkpoint resumes.
async_checkpoints_on_gpu() {  # async_checkpoints_on_gpu TRAIN_GPT DEVICE RANKS DIR
  local job=$1 device=$2 ranks=$3 dir=$4 output
  rm -rf "$dir"
  local common=(--device="$device" --world_size="$ranks" --print_plan=false --log_every=10
    --checkpoint_every=5)
  timeout -k 10 90 "$job" "${common[@]}" --steps=20 --checkpoint_dir="$dir/blocking" \
    --metrics_jsonl="$dir/blocking.jsonl" || return 1
  output=$(timeout -k 10 90 "$job" "${common[@]}" --steps=20 --async_checkpoint \
    --checkpoint_dir="$dir/async" --metrics_jsonl="$dir/async.jsonl" 2>&1) ||
    { echo "$output"; return 1; }
  echo "$output"
  grep -q "checkpoint $dir/async/step-00000020 (in the background" <<<"$output" || return 1
  # Within 1e-5: the GPU's kernels need not repeat a sum's order run to run.
  python3 - "$dir/blocking.jsonl" "$dir/async.jsonl" <<'EOF' ||
import json, sys
a, b = ([json.loads(line)["loss"] for line in open(path)] for path in sys.argv[1:])
close = all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b))
sys.exit(0 if len(a) == len(b) == 20 and close else 1)
EOF
    { echo "async_checkpoint: the losses differ from the blocking run's"; return 1; }
  output=$(timeout -k 10 90 "$job" "${common[@]}" --steps=25 --async_checkpoint --resume \
    --checkpoint_dir="$dir/async" 2>&1) || { echo "$output"; return 1; }
  echo "$output"
  grep -q "resumed from $dir/async/step-00000020" <<<"$output"
}

[[ -d /usr/local/cuda/bin ]] && export PATH="/usr/local/cuda/bin:$PATH"
note "host: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
torch_info=$(python3 -c '
import os, torch
print(os.path.dirname(torch.__file__))
print(torch.__version__, torch.version.cuda, torch.cuda.is_available())
major, minor = (int(v) for v in torch.__version__.split(".")[:2])
print(20 if (major, minor) >= (2, 13) else 17)') || {
  note "python3 cannot import torch"
  exit 1
}
torch_dir=$(sed -n 1p <<<"$torch_info")  # Also CMAKE_PREFIX_PATH: see CMakeLists.txt.
cxx_standard=$(sed -n 3p <<<"$torch_info")  # ATen requires C++20 from torch 2.13 on.
note "torch: $(sed -n 2p <<<"$torch_info") (version, CUDA, GPU visible)" \
  "at $torch_dir; C++$cxx_standard"

# NCCL: the one the torch loads (a pip nvidia-nccl package), so that one
# libnccl.so.2 serves both; else the CUDA toolkit's (CMakeLists.txt).
nccl_root=""
nccl_header=$(find "$(dirname "$torch_dir")/nvidia" -name nccl.h -path '*include*' 2>/dev/null |
  head -1)
[[ -n "$nccl_header" ]] && nccl_root=$(dirname "$(dirname "$nccl_header")")
note "nccl: ${nccl_root:-from the CUDA toolkit}"

deps_dir=${FSDP_GPU_DEPS:-.gpu_deps}
prefix=/tmp/fsdp_gpu_deps
gloo_headers=/tmp/fsdp_gpu_gloo
rm -rf "$prefix" "$gloo_headers"
mkdir -p "$prefix" "$gloo_headers"
for deb in "$deps_dir"/*.deb; do
  case "$(basename "$deb")" in
    libgloo-dev_*) dpkg -x "$deb" "$gloo_headers" ;;
    *) dpkg -x "$deb" "$prefix" ;;
  esac
done
extra_flags=""
if [[ ! -e "$torch_dir/include/gloo/algorithm.h" ]]; then
  extra_flags="-isystem $gloo_headers/usr/include"  # Headers only; the code is in libtorch.
  note "gloo: headers from Debian's libgloo-dev (this torch ships none)"
fi
export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

build=build-gpu
stage configure "$out/build.log" cmake -S . -B "$build" -G Ninja -DFSDP_CUDA=ON \
  -DCMAKE_PREFIX_PATH="$torch_dir" -DFSDP_DEPS_PREFIX="$prefix" \
  -DFSDP_NCCL_ROOT="$nccl_root" -DCMAKE_CXX_FLAGS="$extra_flags" \
  -DCMAKE_CXX_STANDARD="$cxx_standard" || exit 1
# GPUs, not MIG instances (which nvidia-smi -L lists too).
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
# Built apart, so that a target that fails to compile costs only its own
# stages; a stage runs only if this run built its binary (build-gpu may
# hold one from an earlier run).
ac_built=0 nccl_built=0 cuda_built=0
stage build_activation_checkpointing_test "$out/build.log" cmake --build "$build" \
  --target fsdp_activation_checkpointing_test && ac_built=1
if ((gpus >= 2)); then
  stage build_nccl_benchmark "$out/build.log" cmake --build "$build" \
    --target comm_nccl_collectives_benchmark && nccl_built=1
fi
stage build_cuda_targets "$out/build.log" cmake --build "$build" \
  --target fsdp_cuda_test models_cuda_step_benchmark models_train_gpt launch_fsdp_launch &&
  cuda_built=1
if ((cuda_built)); then
  # Each run has a time limit (exit 124 when it hits it), so that one hang
  # leaves the later stages their time.
  stage cuda_test "$out/cuda_test.log" timeout -k 10 240 "$build/fsdp/cuda_test"
  # compute-sanitizer's memcheck over the single-process cases, with the
  # caching allocator off so that every allocation is its own cudaMalloc and
  # an access outside one is reported. It cannot see a missing
  # record_stream: cudaFree waits for the device, and with caching on a freed
  # block stays inside a live allocation (RateLimiterBoundsTheFullParametersInFlight
  # checks those frees instead). Left out: the cases that read the caching
  # allocator's statistics (0 with caching off) and the multi-process one.
  # API errors are not reported: NCCL probes for kernels built for other
  # GPUs and handles the cudaErrorNoKernelImageForDevice it gets.
  memcheck_cases='CudaFsdp.FullShard*:CudaFsdp.Bf16*:CudaFsdp.OffloadedShards*'
  memcheck_cases+=':CudaFsdp.DeviceIdMoves*:CudaFsdp.ProcessGroup*:CudaFsdp.UnshardSees*'
  memcheck_cases+=':CudaFsdp.AnUnshard*'
  if command -v compute-sanitizer >/dev/null; then
    stage cuda_test_memcheck "$out/cuda_test.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      timeout -k 10 150 compute-sanitizer --tool memcheck --leak-check no \
      --report-api-errors no --error-exitcode 9 "$build/fsdp/cuda_test" \
      --gtest_filter="$memcheck_cases"
  else
    note "cuda_test_memcheck: skipped (no compute-sanitizer on the PATH)"
  fi
  # Fused attention's dropout, recomputed by a checkpointed region on the GPU.
  ((ac_built)) &&
    stage activation_checkpointing_cuda "$out/cuda_test.log" \
      timeout -k 10 60 "$build/fsdp/activation_checkpointing_test" --gtest_filter='*Cuda*'
  # --collectives=auto picks NCCL for the rank with a GPU of its own and
  # staged collectives for the two ranks sharing cuda:0.
  for ranks in 1 2; do
    device=cuda
    ((ranks > 1)) && device=cuda:0
    stage "train_gpt_${device}_w$ranks" "$out/cuda_test.log" \
      loss_falls timeout -k 10 90 "$build/models/train_gpt" \
      --device="$device" --world_size="$ranks" --steps=60 --log_every=20 --print_plan=false
  done
  # Fine-tuning an open-weight model: a small random Llama in Hugging Face's
  # layout (tools/tiny_hf_llama.py needs only torch), LoRA adapters over the
  # frozen base in bfloat16, each decoder layer's forward recomputed in
  # backward; the adapters exported in PEFT's format and merged into HF's.
  hf=/tmp/fsdp_gpu_hf_llama
  rm -rf "$hf"
  if stage tiny_hf_llama "$out/cuda_test.log" python3 tools/tiny_hf_llama.py "$hf"; then
    for ranks in 1 2; do
      device=cuda
      ((ranks > 1)) && device=cuda:0
      stage "hf_lora_bf16_checkpointed_${device}_w$ranks" "$out/cuda_test.log" \
        loss_falls timeout -k 10 90 "$build/models/train_gpt" \
        --hf_model="$hf/model" --data_tokens="$hf/tokens.bin" --lora_r=8 \
        --param_dtype=bfloat16 --activation_checkpointing --device="$device" \
        --world_size="$ranks" --steps=60 --log_every=20 --print_plan=false \
        --export_peft="$hf/peft_w$ranks" --export_hf="$hf/merged_w$ranks"
    done
  fi
  # The runs above step the shards with FlatShardAdamW's kExact kernel (the
  # default); this one with PyTorch's fused CUDA kernel.
  stage train_gpt_cuda_w1_fused_optimizer "$out/cuda_test.log" \
    loss_falls timeout -k 10 90 "$build/models/train_gpt" \
    --device=cuda --world_size=1 --steps=60 --log_every=20 --print_plan=false \
    --optimizer_kernel=flat_fused
  # Checkpoints saved from the GPU and resumed there; a run whose update
  # blows the weights up writes none (the fitness check's forward runs on
  # the device).
  stage train_gpt_cuda_checkpoint_resume "$out/cuda_test.log" \
    checkpoints_on_gpu "$build/models/train_gpt" /tmp/fsdp_gpu_checkpoints
  for ranks in 1 2; do
    device=cuda
    ((ranks > 1)) && device=cuda:0
    stage "train_gpt_${device}_w${ranks}_async_checkpoint" "$out/cuda_test.log" \
      async_checkpoints_on_gpu "$build/models/train_gpt" "$device" "$ranks" \
      "/tmp/fsdp_gpu_async_checkpoints_w$ranks"
  done
  # Activation checkpointing on the GPU: the caching allocator's peak with
  # and without, on the long-context GPT of the committed CPU measurement.
  stage activation_checkpointing_memory_cuda "$out/cuda_test.log" \
    timeout -k 10 120 python3 tools/activation_checkpointing_memory.py "$build/models/train_gpt" --device=cuda \
    --world_sizes=1 --raw /tmp/fsdp_activation_checkpointing_cuda_raw.txt
  cat /tmp/fsdp_activation_checkpointing_cuda_raw.txt >>"$out/cuda_test.log" 2>/dev/null
  stage cpp_step_benchmark "$out/build.log" timeout -k 10 240 \
    "$build/models/cuda_step_benchmark" \
    --benchmark_out="$out/cpp_step.json" --benchmark_out_format=json
  # The two NCCL transports (direct, ProcessGroupNCCL) need two GPUs or more;
  # with one, two ranks share it over staged collectives instead.
  if ((nccl_built)); then
    stage nccl_transports "$out/build.log" timeout -k 10 240 \
      "$build/comm/nccl_collectives_benchmark" \
      --benchmark_out="$out/nccl.json" --benchmark_out_format=json
  else
    ((gpus < 2)) && note "nccl_transports: skipped (one GPU: NCCL needs a device per rank)"
  fi
fi
rm -f "$out/pytorch_step.jsonl"
stage pytorch_step_benchmark "$out/build.log" env PYTHONUNBUFFERED=1 \
  timeout -k 10 240 python3 models/fsdp_step_benchmark.py "$out/pytorch_step.jsonl"
# Last: the slowest case (the GPT-2 model's parameters staged through host
# memory every step) must not cost the single-rank table its time.
if ((gpus < 2 && cuda_built)); then
  stage cpp_step_benchmark_w2_shared "$out/build.log" timeout -k 10 240 "$build/launch/fsdp_launch" \
    --nproc_per_node=2 -- "$build/models/cuda_step_benchmark" \
    --benchmark_filter='unwrapped|staged' --benchmark_out="$out/cpp_step_w2.json" \
    --benchmark_out_format=json
fi
if [[ -s "$out/cpp_step.json" && -s "$out/pytorch_step.jsonl" ]]; then
  python3 tools/gpu_step_table.py "$out/cpp_step.json" \
    $([[ -s "$out/cpp_step_w2.json" ]] && echo "$out/cpp_step_w2.json") "$out/pytorch_step.jsonl" \
    >"$out/step_table.md" && cat "$out/step_table.md"
fi

if ((cpu_tests)); then
  stage build_all "$out/build.log" cmake --build "$build" &&
    stage ctest "$out/ctest.log" ctest --test-dir "$build" -j "$(nproc)" -E cuda_test \
      --output-on-failure
  tail -5 "$out/ctest.log" | tee -a "$summary"
fi
