// Checkpoints written in the background, as torch.distributed.checkpoint's
// async_save writes them: at the step boundary Save stages this rank's part
// of the state and returns; a thread of the checkpointer's writes and
// commits it while training goes on.
//
//   auto connect = fsdp::ValueOrThrow(fsdp::GlooConnectorFromEnvironment(env));
//   auto saver = fsdp::ValueOrThrow(fsdp::AsyncCheckpointer::Create(*sharded, connect));
//   for (...) {
//     ... forward, backward, optimizer.step(), ++state.step ...
//     fsdp::ThrowIfError(saver->Poll());  // A save that failed, once written.
//     if (state.step % 100 == 0) {
//       fsdp::ThrowIfError(saver->Save("ckpt", *sharded, &optimizer, state));
//     }
//   }
//   fsdp::ThrowIfError(saver->Wait());
//
// What lands is what SaveCheckpoint would have written at the moment Save
// was called (a Distributed Checkpoint; LoadCheckpoint reads it), by the
// same all-or-nothing rules: every rank's data file is durable (written,
// fsynced, renamed) before rank 0 commits .metadata, and a write that fails
// on any rank fails the checkpoint on every rank and leaves the one that
// was in the directory as it was.
//
// The background commit agrees across ranks on groups of the checkpointer's
// own, with the model's ranks (connected by Create), never on the model's:
// a collective from another thread on the model's groups would interleave
// with training's. Gloo groups suit it: what they carry is host memory.
//
// Staging. Shards in host memory (CPU training, CPU offload: parameters and
// the optimizer's state) are written from where they are, not copied: Save
// holds them (FullyShardedModel::HoldShards) until this rank's file is
// written and synced, and what would change them waits for that first: the
// end of the next backward pass, so before the optimizer steps, and every
// call between steps that may write them (loads among them). The time
// training waited is last_times().held; a write that hangs stalls training
// there. A change the hold cannot stop (an in-place update by hand between
// Save and the next backward) fails the save where a version counter
// records it: in-place ops on a parameter, libtorch's Adam and AdamW and
// the flat-shard optimizers do; writes through .data() or a raw pointer
// (libtorch's SGD steps that way) do not, and would land unseen. Buffers,
// which forward may update, and values are copied; optimizer state other
// than libtorch's Adam, AdamW and SGD and the flat-shard optimizers' is
// read through a copy when Save is called.
// Shards on a GPU are copied into host memory (pinned, on a side stream
// that the stream current at Save waits for), kept from the first Save on
// and reused by every later one (as async_save's cache_staged_state_dict
// keeps it). Under hybrid sharding only the shard group that writes stages
// anything; the other replicas hold and copy nothing.
//
// At most one save is in flight: Save waits for the one before it
// (last_times().waited says how long). Each save's outcome is reported once, by
// whichever of Poll, Wait and the next Save learns it first; a failure is
// never lost, and every rank learns it at the same call (Poll agrees on
// that) while the checkpointer lives: its destructor waits for the save in
// flight and drops the outcome. Every method but the accessors is called by
// every rank of the model's groups at the same point of the program, with
// the model IDLE; the model outlives the checkpointer.
#ifndef FSDP_CHECKPOINT_ASYNC_CHECKPOINT_H_
#define FSDP_CHECKPOINT_ASYNC_CHECKPOINT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "torch/optim/optimizer.h"

namespace fsdp {

class AsyncCheckpointer;
struct SaveGroups;  // statedict/sharded_checkpoint.h (internal).

namespace checkpoint_internal {
class ShardHold;  // The shards a save writes in place (async_checkpoint.cc).
// The main job's SHARDED training checkpoint (optim/training_checkpoint.h's
// SaveTrainingCheckpoint) in the background. Not part of the interface: the
// SHARDED format is the main job's own.
// `metadata`: the manifest's (a CheckpointMetadata).
absl::Status SaveShardedInBackground(AsyncCheckpointer& saver, const std::string& dir,
                                     FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                     const std::map<std::string, std::string>& metadata);
// Tests only: runs on each writer's thread before its write starts, so that
// a test can act while a save is in flight. Set it while none is.
void SetBeforeBackgroundWriteForTesting(std::function<void()> hook);
}  // namespace checkpoint_internal

// What the last save cost, on this rank.
struct AsyncCheckpointTimes {
  // Save: waiting for the save before it; staging the state (holding the
  // shards, copying the rest to host memory) and agreeing that every rank
  // could.
  std::chrono::duration<double> waited{0}, staged{0};
  // The background thread: writing and committing, and the CPU time it
  // took for that (the system calls' share included; the kernel's
  // write-back and the groups' own threads not).
  std::chrono::duration<double> written{0}, write_cpu{0};
  // After Save returned: training waiting for the writer to finish reading
  // the shards it holds (at the end of a backward pass, or a call between
  // steps).
  std::chrono::duration<double> held{0};
  int64_t staged_bytes = 0;  // Bytes copied to host memory (held shards not counted).
  int64_t held_bytes = 0;    // Bytes written from the shards in place.
};

class AsyncCheckpointer {
 public:
  // Every rank of the model's groups calls. Connects the checkpointer's
  // groups through `connect` under `group_name` (no other group of the job
  // may use it): one with the model's shard group's ranks and, under hybrid
  // sharding, one with its replicate group's, named "<group_name>/shard<i>"
  // and "<group_name>/replicate<i>" as comm/hybrid_groups.h names them.
  static absl::StatusOr<std::unique_ptr<AsyncCheckpointer>> Create(
      FullyShardedModel& model, const GroupConnector& connect,
      const std::string& group_name = "async_checkpoint");

  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;
  // Waits for the save in flight; its outcome is lost unless Wait() took it.
  ~AsyncCheckpointer();

  // SaveCheckpoint(dir, model, optimizer, train_state, options) in the
  // background (format kDistributed; a Hugging Face export is refused: it
  // gathers whole tensors, SaveCheckpoint writes it). First waits for the
  // save in flight and returns its failure, if it failed, without starting
  // this one. A refusal of this save (a bad label, another format in `dir`)
  // and a failure to copy are returned here, on every rank; what the write
  // meets is reported later.
  absl::Status Save(const std::string& dir, FullyShardedModel& model,
                    torch::optim::Optimizer* optimizer = nullptr,
                    const TrainState& train_state = {}, const CheckpointIoOptions& options = {});

  // The outcome of the save in flight once it has finished on every rank
  // (one small all-reduce on each of the model's groups per call while it
  // is in flight; none otherwise); OK while it is still writing.
  absl::Status Poll();
  // Waits for the save in flight and returns its outcome (no collective:
  // the commit already agreed). OK when none is in flight.
  absl::Status Wait();

  // A save started whose outcome has not been reported yet.
  bool in_flight() const { return worker_.joinable() || done_inline_; }
  // The directory of the save in flight or of the last one reported.
  const std::string& dir() const { return dir_; }
  // Of the last save: its wait and copy once Save returned, its write once
  // its outcome was reported.
  const AsyncCheckpointTimes& last_times() const { return times_; }

 private:
  friend absl::Status checkpoint_internal::SaveShardedInBackground(
      AsyncCheckpointer&, const std::string&, FullyShardedModel&, torch::optim::Optimizer&,
      const std::map<std::string, std::string>&);

  AsyncCheckpointer(FullyShardedModel& model, std::unique_ptr<Collectives> shard,
                    std::unique_ptr<Collectives> replicate);

  // Save's common part: waits for the save in flight, stages with `stage`
  // (which copies into host memory and returns the write to run), agrees
  // that every rank staged, and starts the write.
  using Write = std::function<absl::Status(const SaveGroups&)>;
  absl::Status Start(FullyShardedModel& model, const std::string& dir,
                     const std::function<absl::StatusOr<Write>()>& stage);
  // Joins the writer and returns its outcome once.
  absl::Status Finish();
  // Of the save being staged, then in flight: the shards it writes in place.
  std::shared_ptr<checkpoint_internal::ShardHold> hold_;

  FullyShardedModel* const model_;
  const std::unique_ptr<Collectives> shard_group_;
  const std::unique_ptr<Collectives> replicate_group_;
  std::thread worker_;
  std::mutex mu_;
  bool done_ = false;  // Guarded by mu_: the writer has returned.
  // The write ran on the calling thread (no thread could be started); its
  // outcome waits to be reported. Main thread only.
  bool done_inline_ = false;
  absl::Status outcome_;  // Guarded by mu_; set with done_.
  // Guarded by mu_; set with done_.
  std::chrono::duration<double> written_{0}, write_cpu_{0};
  std::string dir_;
  AsyncCheckpointTimes times_;
  // The host copy of the last save, reused by the next.
  std::vector<at::Tensor> staging_buffers_;
};

}  // namespace fsdp

#endif  // FSDP_CHECKPOINT_ASYNC_CHECKPOINT_H_
