// Collectives: the communication interface the FSDP core depends on.
//
// One object per rank and process group. It offers exactly the operations
// fully sharded training needs, over flat 1-D tensors:
//   all-gather into one tensor   (unshard a flat parameter)
//   reduce-scatter of one tensor (shard a flat gradient; sum or average)
//   all-reduce                   (NO_SHARD gradients, replicate groups, norms)
//   all-to-all                   (quantized gradient reduction: each rank
//                                 sums the chunks the others coded for it)
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
//   * Tensors live where the implementation handles them (HandlesDevice:
//     the host for Gloo; the group's CUDA device, and the host by staging,
//     for NCCL), input and output on the same device.
//   * Supported dtypes: float32, float64, float16 and bfloat16 for every
//     operation, and uint8 for the ones that only move bytes (all-gather,
//     all-to-all, broadcast: coded payloads, comm/block_quantization.h). How 16-bit
//     reductions accumulate is the implementation's (Gloo: float32, see
//     gloo_collectives.h).
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
// Fingerprints (comm/fingerprint.h)
//   Every collective is recorded with the label its caller set
//   (CollectiveLabel: the FSDP unit and phase). With a FingerprintExchange
//   attached (Gloo groups get one over their store), a failed collective
//   makes this rank publish its recent history and wait up to
//   FingerprintOptions::report_timeout for the other ranks', and the error
//   Wait() throws names the first collective where the ranks' histories
//   differ, which ranks issued what there, and the ranks that sent nothing
//   (dead, or stuck elsewhere). VerifyConsistency compares the histories on
//   demand (FSDP calls it every N steps).
//
// Thread safety: one thread issues the collectives of a Collectives object;
// a work may be waited on another thread; counters() may be read from any
// thread. Collectives are neither copyable
// nor movable.
//
// Implementations live in separate targets (gloo_collectives for CPU,
// nccl_collectives for CUDA under --config=cuda). They
// override the Do* hooks; the public methods validate arguments and count
// calls and bytes, the same way for every implementation.
#ifndef FSDP_COMM_COLLECTIVES_H_
#define FSDP_COMM_COLLECTIVES_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"
#include "comm/fingerprint.h"

namespace fsdp {

enum class ReduceOp { kSum, kAvg };

const char* ReduceOpName(ReduceOp op);

// What one rank has issued since creation (or the last ResetCounters()).
// `bytes` counts the full-size buffer of each call: the output of an
// all-gather, the input of a reduce-scatter, the tensor of an all-reduce or
// a broadcast, the input of an all-to-all; this is the quantity FSDP reports
// as "all-gather bytes".
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

struct FingerprintOptions {
  // Records kept per rank for explaining a divergence.
  int capacity = 128;
  // How long a rank whose collective failed waits for the other ranks'
  // reports (they send theirs when their own collectives fail or time out,
  // or when they stop: ReportStopped) before naming the silent ones; also
  // the bound on VerifyConsistency's wait. A dead rank costs this much on
  // top of the failure itself.
  std::chrono::milliseconds report_timeout = std::chrono::seconds(10);
  // Compare histories before every collective: catches a mismatch before
  // it moves any data, at a store round trip per collective; for hunting a
  // divergence (PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL does the same).
  bool verify_each_collective = false;
};

// A work that was complete when returned (world size 1, empty tensors).
std::unique_ptr<CollectiveWork> MakeCompletedWork();

// A work that failed before anything was sent: Wait() throws c10::Error
// with `error`, every time.
std::unique_ptr<CollectiveWork> MakeFailedWork(std::string error);

class Collectives {
 public:
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;
  virtual ~Collectives() = default;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // Where the tensors of this group's collectives may live; others are
  // refused before anything is sent. The default is the host (Gloo).
  virtual bool HandlesDevice(const c10::Device& device) const { return device.is_cpu(); }
  virtual std::string DevicesHandled() const { return "it handles CPU tensors"; }

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

  // output[r*n : (r+1)*n] = input_r[rank*n : (rank+1)*n], n = input.numel() / W:
  // chunk r of every rank's input goes to rank r.
  // REQUIRES: input and output contiguous and 1-D, distinct, same dtype,
  //           device and number of elements, a multiple of world_size().
  std::unique_ptr<CollectiveWork> AllToAll(const at::Tensor& output, const at::Tensor& input);

  // tensor = op over ranks of tensor, in place.
  // REQUIRES: tensor contiguous (any shape).
  std::unique_ptr<CollectiveWork> AllReduce(const at::Tensor& tensor, ReduceOp op);

  // tensor = tensor of rank `root`, in place. REQUIRES: 0 <= root < world_size().
  std::unique_ptr<CollectiveWork> Broadcast(const at::Tensor& tensor, int root);

  // Returns once every rank has entered the barrier; throws on timeout.
  void Barrier();

  CollectiveCounters counters() const;
  void ResetCounters();

  // The label recorded with the following collectives (CollectiveLabel
  // sets and restores it).
  void SetLabel(std::string unit, std::string phase);
  const std::string& label_unit() const { return label_unit_; }
  const std::string& label_phase() const { return label_phase_; }

  const FingerprintLog& fingerprints() const { return *fingerprints_; }

  // Where this group's ranks compare histories (one per group and rank).
  // REQUIRES: no collective issued yet.
  void AttachFingerprintExchange(std::shared_ptr<FingerprintExchange> exchange,
                                 const FingerprintOptions& options);

  // Compares this rank's collective history with every other rank's and
  // throws c10::Error naming the first divergence when they differ. Every
  // rank must call it at the same point of its program. Goes through the
  // exchange when one is attached (so a diverged group cannot mispair the
  // check itself), else through this group (two all-gathers).
  void VerifyConsistency();

  // Tells the other ranks, through the exchange, that this rank stops
  // issuing collectives on this group and why (an exception unwinding the
  // training loop); their failure reports then quote it instead of waiting
  // for this rank. Does nothing without an exchange or when this rank
  // already reported a failure.
  void ReportStopped(const std::string& why);

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
  virtual std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                                     const at::Tensor& input) = 0;
  virtual void DoBarrier() = 0;

  // "rank 2 of 4" — the prefix of every error message.
  std::string Describe() const;

 private:
  friend class ExplainedWork;
  void Count(CollectiveOp op, int64_t bytes);
  // Records the collective about to be issued; with verify_each_collective,
  // then compares the ranks' histories, this collective included.
  CollectiveRecord Record(CollectiveOp op, int64_t numel, at::ScalarType dtype, int argument);
  // Wraps `work` so that its failure is explained (when an exchange is
  // attached).
  std::unique_ptr<CollectiveWork> Explained(CollectiveRecord record,
                                            std::unique_ptr<CollectiveWork> work);
  // Publishes this rank's report of its failure and returns the ranks'
  // divergence, for the error message; once per group (later failures get
  // the first explanation).
  std::string ExplainFailure(const std::string& error);
  // Every rank's report for `round` (through the exchange or this group).
  std::vector<std::optional<FingerprintReport>> ExchangeReports(const std::string& round,
                                                                const std::string& status);

  const int rank_;
  const int world_size_;
  std::array<std::atomic<int64_t>, kNumCollectiveOps> calls_{};
  std::array<std::atomic<int64_t>, kNumCollectiveOps> bytes_{};
  std::string label_unit_;
  std::string label_phase_;
  std::unique_ptr<FingerprintLog> fingerprints_;
  std::shared_ptr<FingerprintExchange> exchange_;
  FingerprintOptions fingerprint_options_;
  int64_t checks_ = 0;  // VerifyConsistency rounds so far.
  std::mutex failure_mu_;
  bool failure_published_ = false;  // This rank's "failure" report is out.
  std::string failure_explanation_;
};

// Sets `group`'s label for the collectives issued in its scope and restores
// the previous one after:
//   CollectiveLabel label(group, "blocks.1", "forward");
class CollectiveLabel {
 public:
  CollectiveLabel(Collectives& group, std::string unit, std::string phase);
  // Labels two groups (hybrid sharding's shard and replicate groups);
  // `second` may be null.
  CollectiveLabel(Collectives& group, Collectives* second, std::string unit,
                  std::string phase);
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;
  ~CollectiveLabel();

 private:
  struct Saved {
    Collectives* group;
    std::string unit, phase;
  };
  std::vector<Saved> saved_;
};

// Rank `root`'s `bytes` on every rank (two broadcasts: the length, then the
// bytes as the bit patterns of float64 words, which broadcast copies
// without arithmetic). Every rank of the group must call it. Throws
// c10::Error as the collectives do.
void BroadcastBytes(Collectives& group, std::string& bytes, int root);
// The bytes of the job's rank 0 (rank 0 of `group` and, under hybrid
// sharding, of `replicate`) on every rank of both: across the replicate
// groups first, then within each group. Every rank of both calls.
void BroadcastBytesFromRank0(Collectives& group, Collectives* replicate, std::string& bytes);

// Every rank's `mine`, in rank order, on every rank (two all-gathers, the
// bytes carried as BroadcastBytes carries them).
std::vector<std::string> AllGatherBytes(Collectives& group, const std::string& mine);

// Connects one group of ranks over some backend: this process as rank
// `rank` of `size`, under `group_name`, which every member passes alike and
// no other group of the job uses (backends derive their store keys from
// it). Code that makes several groups (comm/hybrid_groups.h) takes one, so
// it works over any backend: GlooGroupConnector, NcclGroupConnector.
using GroupConnector = std::function<absl::StatusOr<std::unique_ptr<Collectives>>(
    const std::string& group_name, int rank, int size)>;

}  // namespace fsdp

#endif  // FSDP_COMM_COLLECTIVES_H_
