// The tensors of the small "model" whose SHARDED checkpoints seed the
// sharded_manifest fuzzer (write_sharded_seeds.cc writes them; the fuzzer
// loads into them): sharded tensors split evenly or not, one that a rank
// holds none of, a tied tensor with an alias, replicated buffers of other
// dtypes, a scalar, an empty tensor, and an optimizer entry under "optim/".
#ifndef FSDP_STATEDICT_FUZZ_SHARDED_MANIFEST_MODEL_H_
#define FSDP_STATEDICT_FUZZ_SHARDED_MANIFEST_MODEL_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "statedict/sharded_checkpoint.h"

namespace fsdp {
namespace fuzz {

// Rank `rank` of `world`'s part of each tensor (a sharded tensor's
// elements split in contiguous runs, rank 0 taking the remainder first),
// with deterministic values. `with_optim`: include "optim/" entries.
inline std::vector<CheckpointTensor> ShardedManifestModel(int rank, int world, bool with_optim) {
  struct Spec {
    const char* fqn;
    std::vector<std::string> aliases;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    bool sharded;
  };
  std::vector<Spec> specs = {
      {"layer.weight", {}, {4, 6}, at::kFloat, true},
      {"layer.bias", {}, {5}, at::kFloat, true},
      {"embed.weight", {"head.weight"}, {5, 4}, at::kFloat, true},
      {"gate", {}, {1}, at::kFloat, true},
      {"norm.running_mean", {}, {4}, at::kDouble, false},
      {"norm.num_batches_tracked", {}, {}, at::kLong, false},
      {"empty", {}, {0, 3}, at::kFloat, false},
  };
  if (with_optim) specs.push_back({"optim/layer.weight.exp_avg", {}, {4, 6}, at::kFloat, true});
  std::vector<CheckpointTensor> tensors;
  for (size_t k = 0; k < specs.size(); ++k) {
    const Spec& s = specs[k];
    CheckpointTensor t;
    t.fqn = s.fqn;
    t.aliases = s.aliases;
    t.shape = s.shape;
    t.dtype = s.dtype;
    t.sharded = s.sharded;
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    if (s.sharded) {
      const int64_t base = numel / world, extra = numel % world;
      t.lo = rank * base + std::min<int64_t>(rank, extra);
      t.hi = t.lo + base + (rank < extra ? 1 : 0);
    } else {
      t.lo = 0;
      t.hi = numel;
    }
    t.local = (at::arange(t.lo, t.hi, at::kDouble) + 100.0 * static_cast<double>(k)).to(s.dtype);
    tensors.push_back(std::move(t));
  }
  return tensors;
}

}  // namespace fuzz
}  // namespace fsdp

#endif  // FSDP_STATEDICT_FUZZ_SHARDED_MANIFEST_MODEL_H_
