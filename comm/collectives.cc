#include "comm/collectives.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "c10/util/Exception.h"

namespace fsdp {
namespace {

class CompletedWork final : public CollectiveWork {
 public:
  void Wait() override {}
};

bool IsSupportedDtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

// Checks one tensor argument of operation `op`; `role` is "input", "output"
// or "tensor".
void CheckTensor(const std::string& who, CollectiveOp op, const char* role,
                 const at::Tensor& t, bool require_1d) {
  TORCH_CHECK(t.defined(), who, ": ", CollectiveOpName(op), ": ", role,
              " is an undefined tensor");
  TORCH_CHECK(IsSupportedDtype(t.scalar_type()), who, ": ", CollectiveOpName(op),
              ": ", role, " has dtype ", t.scalar_type(),
              "; supported are Float, Double, Half and BFloat16");
  TORCH_CHECK(t.device().is_cpu(), who, ": ", CollectiveOpName(op), ": ", role,
              " is on ", t.device(), "; this implementation handles CPU tensors");
  TORCH_CHECK(t.is_contiguous(), who, ": ", CollectiveOpName(op), ": ", role,
              " must be contiguous");
  TORCH_CHECK(!require_1d || t.dim() == 1, who, ": ", CollectiveOpName(op), ": ",
              role, " must be 1-D (a flat buffer) but has shape ", t.sizes());
}

// Checks the (full, shard) pair of an all-gather or a reduce-scatter.
void CheckFlatPair(const std::string& who, CollectiveOp op, int world_size,
                   const at::Tensor& full, const char* full_role,
                   const at::Tensor& shard, const char* shard_role) {
  CheckTensor(who, op, full_role, full, /*require_1d=*/true);
  CheckTensor(who, op, shard_role, shard, /*require_1d=*/true);
  TORCH_CHECK(full.scalar_type() == shard.scalar_type(), who, ": ",
              CollectiveOpName(op), ": ", full_role, " dtype ", full.scalar_type(),
              " does not match ", shard_role, " dtype ", shard.scalar_type());
  TORCH_CHECK(full.numel() == world_size * shard.numel(), who, ": ",
              CollectiveOpName(op), ": ", full_role, " has ", full.numel(),
              " elements but must have world_size * ", shard_role, ".numel() = ",
              world_size, " * ", shard.numel(), " = ", world_size * shard.numel());
}

}  // namespace

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "invalid";
}

const char* CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather:
      return "all-gather";
    case CollectiveOp::kReduceScatter:
      return "reduce-scatter";
    case CollectiveOp::kAllReduce:
      return "all-reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kBarrier:
      return "barrier";
  }
  return "invalid";
}

std::unique_ptr<CollectiveWork> MakeCompletedWork() {
  return std::make_unique<CompletedWork>();
}

Collectives::Collectives(int rank, int world_size)
    : rank_(rank), world_size_(world_size) {
  TORCH_CHECK(world_size > 0 && rank >= 0 && rank < world_size,
              "Collectives: rank ", rank, " is not in [0, world_size = ", world_size,
              ")");
}

std::string Collectives::Describe() const {
  return "rank " + std::to_string(rank_) + " of " + std::to_string(world_size_);
}

void Collectives::Count(CollectiveOp op, int64_t bytes) {
  const int i = static_cast<int>(op);
  calls_[i].fetch_add(1, std::memory_order_relaxed);
  bytes_[i].fetch_add(bytes, std::memory_order_relaxed);
}

CollectiveCounters Collectives::counters() const {
  CollectiveCounters out;
  for (int i = 0; i < kNumCollectiveOps; ++i) {
    out.calls[i] = calls_[i].load(std::memory_order_relaxed);
    out.bytes[i] = bytes_[i].load(std::memory_order_relaxed);
  }
  return out;
}

void Collectives::ResetCounters() {
  for (int i = 0; i < kNumCollectiveOps; ++i) {
    calls_[i].store(0, std::memory_order_relaxed);
    bytes_[i].store(0, std::memory_order_relaxed);
  }
}

std::unique_ptr<CollectiveWork> Collectives::AllGatherIntoTensor(
    const at::Tensor& output, const at::Tensor& input) {
  CheckFlatPair(Describe(), CollectiveOp::kAllGather, world_size_, output, "output",
                input, "input");
  Count(CollectiveOp::kAllGather, output.nbytes());
  if (input.numel() == 0) return MakeCompletedWork();
  if (world_size_ == 1) {
    if (!output.is_same(input)) output.copy_(input);
    return MakeCompletedWork();
  }
  return DoAllGather(output, input);
}

std::unique_ptr<CollectiveWork> Collectives::ReduceScatterTensor(
    const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  CheckFlatPair(Describe(), CollectiveOp::kReduceScatter, world_size_, input, "input",
                output, "output");
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, Describe(),
              ": reduce-scatter: invalid ReduceOp ", static_cast<int>(op));
  Count(CollectiveOp::kReduceScatter, input.nbytes());
  if (output.numel() == 0) return MakeCompletedWork();
  if (world_size_ == 1) {
    output.copy_(input);  // The sum and the average over one rank.
    return MakeCompletedWork();
  }
  return DoReduceScatter(output, input, op);
}

std::unique_ptr<CollectiveWork> Collectives::AllReduce(const at::Tensor& tensor,
                                                       ReduceOp op) {
  CheckTensor(Describe(), CollectiveOp::kAllReduce, "tensor", tensor,
              /*require_1d=*/false);
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, Describe(),
              ": all-reduce: invalid ReduceOp ", static_cast<int>(op));
  Count(CollectiveOp::kAllReduce, tensor.nbytes());
  if (tensor.numel() == 0 || world_size_ == 1) return MakeCompletedWork();
  return DoAllReduce(tensor, op);
}

std::unique_ptr<CollectiveWork> Collectives::Broadcast(const at::Tensor& tensor,
                                                       int root) {
  CheckTensor(Describe(), CollectiveOp::kBroadcast, "tensor", tensor,
              /*require_1d=*/false);
  TORCH_CHECK(root >= 0 && root < world_size_, Describe(), ": broadcast: root ", root,
              " is not a rank of this group (world_size ", world_size_, ")");
  Count(CollectiveOp::kBroadcast, tensor.nbytes());
  if (tensor.numel() == 0 || world_size_ == 1) return MakeCompletedWork();
  return DoBroadcast(tensor, root);
}

void Collectives::Barrier() {
  Count(CollectiveOp::kBarrier, 0);
  if (world_size_ > 1) DoBarrier();
}

void BroadcastBytes(Collectives& group, std::string& bytes, int root) {
  at::Tensor length = at::full({1}, static_cast<double>(bytes.size()), at::kDouble);
  group.Broadcast(length, root)->Wait();
  const int64_t size = static_cast<int64_t>(length.item<double>());
  const int64_t words = std::max<int64_t>(1, (size + 7) / 8);
  at::Tensor payload = at::zeros({words}, at::kDouble);
  if (group.rank() == root && size > 0) std::memcpy(payload.data_ptr(), bytes.data(), size);
  group.Broadcast(payload, root)->Wait();
  bytes.assign(static_cast<const char*>(payload.data_ptr()), size);
}

std::vector<std::string> AllGatherBytes(Collectives& group, const std::string& mine) {
  const int world = group.world_size();
  at::Tensor lengths = at::empty({world}, at::kDouble);
  group.AllGatherIntoTensor(lengths, at::full({1}, static_cast<double>(mine.size()), at::kDouble))
      ->Wait();
  const int64_t longest = static_cast<int64_t>(lengths.max().item<double>());
  const int64_t words = std::max<int64_t>(1, (longest + 7) / 8);
  at::Tensor padded = at::zeros({words}, at::kDouble);
  if (!mine.empty()) std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world * words}, at::kDouble);
  group.AllGatherIntoTensor(all, padded)->Wait();
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    out.emplace_back(static_cast<const char*>(all.data_ptr()) + r * words * 8,
                     static_cast<size_t>(lengths[r].item<double>()));
  }
  return out;
}

}  // namespace fsdp
