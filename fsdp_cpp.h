// fsdp_cpp: Fully Sharded Data Parallel for libtorch. This header is all an
// ordinary training program includes (the library's Bazel target
// @fsdp_cpp//:fsdp_cpp, CMake's fsdp_cpp::fsdp_cpp):
//
//   the process group   fsdp::InitProcessGroup() (comm/rendezvous.h)
//   wrapping            fsdp::FullyShardedModel::Wrap, fsdp::FsdpOptions,
//                       wrap policies, fsdp::UnitModule (fsdp/fully_shard.h,
//                       fsdp/unit_module.h, policies/wrap_policy.h)
//   between steps       NoSync, SummonFullParams, ClipGradNorm, Apply,
//                       UniqueParameters (fsdp/utilities.h); CheckReplicas,
//                       CheckGradientNormAgrees (checkpoint/replicas.h)
//   state               Get/SetModelStateDict, Get/SetOptimizerStateDict,
//                       Save/LoadCheckpoint, Save/LoadTorchFile
//                       (checkpoint/checkpoint.h; Hugging Face
//                       safetensors checkpoints are a CheckpointFormat);
//                       AsyncCheckpointer saves in the background
//                       (checkpoint/async_checkpoint.h)
//   errors              absl::Status between steps; fsdp::ThrowIfError and
//                       fsdp::ValueOrThrow turn one into an exception
//                       (base/status.h)
//
// README.md has a complete program; docs/ says more about each part.
#ifndef FSDP_CPP_H_
#define FSDP_CPP_H_

#include "base/status.h"
#include "checkpoint/async_checkpoint.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/replicas.h"
#include "comm/rendezvous.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_forward.h"
#include "fsdp/unit_module.h"
#include "fsdp/utilities.h"
#include "policies/wrap_policy.h"

#endif  // FSDP_CPP_H_
