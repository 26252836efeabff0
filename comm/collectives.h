// Collectives: the communication interface the FSDP core depends on.
//
// One object per rank and process group. It offers exactly the operations
// fully sharded training needs, over flat 1-D tensors:
//   all-gather into one tensor   (unshard a flat parameter)
//   reduce-scatter of one tensor (shard a flat gradient; sum or average)
//   all-reduce                   (NO_SHARD gradients, replicate groups, norms)
//   broadcast, barrier           (module-state sync, checkpoints)
//
// Semantics
//   * Every rank of the group must issue the same collectives in the same
//     order with matching sizes and dtypes; a mismatch that this rank can see
//     (its own arguments) is refused before anything is sent.
//   * Operations are asynchronous: they return a CollectiveWork, and the
//     output tensor may be read only after Wait() returns. Inputs must not be
//     modified before then. Implementations may finish part of the work (a
//     local reduction, a cast) inside Wait(), on the waiting thread.
//   * Supported dtypes: float32, float64, float16 and bfloat16 for every
//     operation. How 16-bit reductions accumulate is the implementation's
//     (Gloo: float32, see gloo_collectives.h).
//   * kAvg divides the sum by the group size.
//
// Errors
//   Caller mistakes (wrong output size, mismatched dtypes, non-contiguous or
//   non-1-D tensors, a root out of range) throw c10::Error before any
//   communication, naming the operation, the rank and the mismatch. Failures
//   in transit (a timeout, a dead peer) throw c10::Error from Wait(), naming
//   the operation, the rank and the cause. A failed group must not be used
//   again.
//
// Thread safety: one thread issues the collectives of a Collectives object;
// a work may be waited on another thread; counters() may be read from any
// thread. Collectives are neither copyable
// nor movable.
//
// Implementations live in separate targets (gloo_collectives for CPU). They
// override the Do* hooks; the public methods validate arguments and count
// calls and bytes, the same way for every implementation.
#ifndef FSDP_COMM_COLLECTIVES_H_
#define FSDP_COMM_COLLECTIVES_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"

namespace fsdp {

enum class ReduceOp { kSum, kAvg };

const char* ReduceOpName(ReduceOp op);

// The operations of the interface, for counters and error messages.
enum class CollectiveOp : int {
  kAllGather = 0,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
};
inline constexpr int kNumCollectiveOps = 5;

const char* CollectiveOpName(CollectiveOp op);

// What one rank has issued since creation (or the last ResetCounters()).
// `bytes` counts the full-size buffer of each call: the output of an
// all-gather, the input of a reduce-scatter, the tensor of an all-reduce or
// a broadcast; this is the quantity FSDP reports as "all-gather bytes".
struct CollectiveCounters {
  std::array<int64_t, kNumCollectiveOps> calls{};
  std::array<int64_t, kNumCollectiveOps> bytes{};

  int64_t Calls(CollectiveOp op) const { return calls[static_cast<int>(op)]; }
  int64_t Bytes(CollectiveOp op) const { return bytes[static_cast<int>(op)]; }
};

// A pending collective. Wait() is idempotent: after the first call it
// returns at once if the work succeeded and throws the same error if it
// failed. Destroying an unwaited work waits for it (errors
// are then swallowed, since destructors cannot throw), so that buffers are
// never released while a transfer still uses them. A work must not outlive
// the Collectives that issued it.
class CollectiveWork {
 public:
  CollectiveWork() = default;
  CollectiveWork(const CollectiveWork&) = delete;
  CollectiveWork& operator=(const CollectiveWork&) = delete;
  virtual ~CollectiveWork() = default;

  // Blocks until the output is complete. Throws c10::Error on failure.
  virtual void Wait() = 0;
};

// A work that was complete when returned (world size 1, empty tensors).
std::unique_ptr<CollectiveWork> MakeCompletedWork();

class Collectives {
 public:
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;
  virtual ~Collectives() = default;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // output[r*n : (r+1)*n] = input of rank r, where n = input.numel().
  // REQUIRES: input and output contiguous and 1-D, same dtype and device,
  //           output.numel() == world_size() * input.numel().
  std::unique_ptr<CollectiveWork> AllGatherIntoTensor(const at::Tensor& output,
                                                      const at::Tensor& input);

  // output = op over ranks r of input_r[rank*n : (rank+1)*n], n = output.numel().
  // REQUIRES: as AllGatherIntoTensor with the roles of input and output
  //           swapped.
  std::unique_ptr<CollectiveWork> ReduceScatterTensor(const at::Tensor& output,
                                                      const at::Tensor& input,
                                                      ReduceOp op);

  // tensor = op over ranks of tensor, in place.
  // REQUIRES: tensor contiguous (any shape).
  std::unique_ptr<CollectiveWork> AllReduce(const at::Tensor& tensor, ReduceOp op);

  // tensor = tensor of rank `root`, in place. REQUIRES: 0 <= root < world_size().
  std::unique_ptr<CollectiveWork> Broadcast(const at::Tensor& tensor, int root);

  // Returns once every rank has entered the barrier; throws on timeout.
  void Barrier();

  CollectiveCounters counters() const;
  void ResetCounters();

 protected:
  // REQUIRES: 0 <= rank < world_size.
  Collectives(int rank, int world_size);

  // Called with validated arguments; world_size() > 1 and tensors non-empty
  // (the public methods complete trivial cases themselves).
  virtual std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                                      const at::Tensor& input) = 0;
  virtual std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                          const at::Tensor& input,
                                                          ReduceOp op) = 0;
  virtual std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor,
                                                      ReduceOp op) = 0;
  virtual std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor,
                                                      int root) = 0;
  virtual void DoBarrier() = 0;

  // "rank 2 of 4" — the prefix of every error message.
  std::string Describe() const;

 private:
  void Count(CollectiveOp op, int64_t bytes);

  const int rank_;
  const int world_size_;
  std::array<std::atomic<int64_t>, kNumCollectiveOps> calls_{};
  std::array<std::atomic<int64_t>, kNumCollectiveOps> bytes_{};
};

// Rank `root`'s `bytes` on every rank (two broadcasts: the length, then the
// bytes as the bit patterns of float64 words, which broadcast copies
// without arithmetic). Every rank of the group must call it. Throws
// c10::Error as the collectives do.
void BroadcastBytes(Collectives& group, std::string& bytes, int root);

// Every rank's `mine`, in rank order, on every rank (two all-gathers, the
// bytes carried as BroadcastBytes carries them).
std::vector<std::string> AllGatherBytes(Collectives& group, const std::string& mine);

}  // namespace fsdp

#endif  // FSDP_COMM_COLLECTIVES_H_
